"""Discrete-event simulator of push vs pull MoE dispatch/combine on NVLink topologies."""
