"""mok inside other libraries' models. Each integration is its own module, imports its library
only when called (``import mok`` and ``import mok.integrations.x`` never pull it in) and names
the extra that installs it when it is missing:

* :mod:`mok.integrations.hf`: an experts implementation of HF transformers' MoE models
  (``pip install "mok[hf]"``);
* :mod:`mok.integrations.torchtitan`: torchtitan's routed experts replaced by mok's layer, with
  mok's own expert parallelism (torchtitan itself is not a dependency: the adapter reads its
  modules' weights and keeps its checkpoint names);
* :mod:`mok.integrations.megatron`: Megatron-core's MoE layer (dispatch, routed experts, combine)
  replaced by mok's layer, with mok's own expert parallelism and ``main_grad`` (Megatron-core is
  not a dependency: the adapter reads its modules' weights).
"""
