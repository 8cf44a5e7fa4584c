"""MoKConfig: the knobs of the layer, validated, with a JSON form shared with ``mok-sim tune``.

The JSON the simulator writes (``mok-sim tune --emit-config``) and :meth:`MoKConfig.to_json`
produce is ``{"format": "mok-config/1", "config": {field: value, ...}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from mok.errors import MoKConfigError

__all__ = ["MoKConfig", "CONFIG_FORMAT", "DISPATCH_MODES", "COMBINE_MODES", "ROW_ORDERS"]

CONFIG_FORMAT = "mok-config/1"
DISPATCH_MODES = ("pull", "push", "dedup_pull")
COMBINE_MODES = ("push", "pull")
ROW_ORDERS = ("interleaved", "source")
# A bound on num_comm_sms that no GPU reaches (H100 / H200 SXM have 132 SMs, B200 148): the
# config cannot know its GPU; the workspace checks the count against the device's own.
MAX_COMM_SMS = 1024


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False


@dataclass(frozen=True)
class MoKConfig:
    """Configuration of the mok layer (identical on every rank of the group).

    dispatch_mode: ``pull`` (MoK: destination loads (token, k) rows), ``push`` (source stores
        them), ``dedup_pull`` (one NVLink row per (token, destination rank), then local fan-out).
    combine_mode: ``push`` (expert owner stores into the home rank's slots) or ``pull`` (home
        rank reads the owners' outputs). ``dedup_pull`` pairs with the dedup ``push`` combine.
    num_comm_sms / num_comm_sms_bwd: SMs (persistent blocks) of the communication kernels in
        forward / backward.
    minibatch_size: received rows per destination rank per round (the overlap unit).
    macrobatch_size: rows of the receive ring; >= minibatch_size and a multiple of it
        (0: one minibatch). Recorded for the fused megakernel; the standalone kernels keep the
        whole receive buffer.
    row_tile: GEMM row tile; every expert region is padded to a multiple of it.
    capacity_factor: receive-buffer rows per rank = capacity_factor * num_tokens * num_topk
        plus padding (the factor capped at the number of ranks, which holds any routing).
        Overflow raises :class:`mok.MoKCapacityError`; nothing is dropped.
    wait_timeout_ms: bound of every spin-wait; expiry raises :class:`mok.MoKTimeoutError`.
    max_tokens: the most tokens one rank passes in one call. The workspace is sized for it
        once; every call with 0..max_tokens tokens per rank (ranks may differ) reuses it
        without allocating or synchronising, and more raise :class:`mok.MoKCapacityError` on
        every rank. 0 (the default): the larger of a default size (8192 tokens per rank, less
        where that would take more than 1/16 of the GPU's memory; ``mok.sizing``) and the
        largest count any rank passes in the first call; at one rank the workspace grows
        when a later call passes more.
    row_order: the order of an expert's rows in the receive buffer. ``interleaved`` (the
        default): the source ranks take turns, so each minibatch draws rows from every peer.
        ``source``: rank 0's rows, then rank 1's, ... (each in token order). Give rank r the
        global tokens after those of ranks < r and every expert sees its rows in global token
        order at any number of ranks: with non-dedup modes the output and every gradient are
        then bitwise those of one rank over the whole batch (the weight gradients' sums over
        rows run in the same order). Interleaved rows give the same output, input and
        router-weight gradients, and weight gradients within an fp32 summation order of them.
    num_sms: the SMs a layer call's kernels may use, all of them together (the communication
        kernels, the fused layer's communication and GEMM blocks, the experts' forward and
        backward GEMMs); 0 (the default): every SM of the GPU. The rest stay free for work
        overlapped on other streams, or for other ranks sharing the GPU (under MPS).
    """

    dispatch_mode: str = "dedup_pull"
    combine_mode: str = "push"
    num_comm_sms: int = 24
    num_comm_sms_bwd: int = 24
    minibatch_size: int = 4096
    macrobatch_size: int = 0
    row_tile: int = 128
    capacity_factor: float = 2.0
    wait_timeout_ms: float = 10_000.0
    max_tokens: int = 0
    row_order: str = "interleaved"
    num_sms: int = 0

    def __post_init__(self) -> None:
        def bad(msg: str) -> MoKConfigError:
            return MoKConfigError(f"MoKConfig: {msg}")

        if self.dispatch_mode not in DISPATCH_MODES:
            raise bad(
                f"unknown dispatch_mode {self.dispatch_mode!r}; supported: "
                f"{', '.join(DISPATCH_MODES)}"
            )
        if self.combine_mode not in COMBINE_MODES:
            raise bad(
                f"unknown combine_mode {self.combine_mode!r}; supported: {', '.join(COMBINE_MODES)}"
            )
        if self.row_order not in ROW_ORDERS:
            raise bad(f"unknown row_order {self.row_order!r}; supported: {', '.join(ROW_ORDERS)}")
        if self.dispatch_mode == "dedup_pull" and self.combine_mode != "push":
            raise bad(
                "dispatch_mode='dedup_pull' pairs with the dedup push combine; "
                f"found combine_mode={self.combine_mode!r}, use 'push'"
            )
        for name in ("num_comm_sms", "num_comm_sms_bwd", "minibatch_size", "row_tile"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(f"{name} must be an int (found {type(v).__name__} {v!r})")
        for name in ("num_comm_sms", "num_comm_sms_bwd"):
            v = getattr(self, name)
            if not 1 <= v <= MAX_COMM_SMS:
                raise bad(f"{name} must be in [1, {MAX_COMM_SMS}] (found {v})")
        if self.row_tile < 1 or self.row_tile & (self.row_tile - 1):
            raise bad(f"row_tile must be a positive power of two (found {self.row_tile})")
        if self.minibatch_size < self.row_tile or self.minibatch_size % self.row_tile:
            raise bad(
                f"minibatch_size must be a positive multiple of row_tile={self.row_tile} "
                f"(found {self.minibatch_size})"
            )
        mb = self.macrobatch_size
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
            raise bad(f"macrobatch_size must be an int >= 0 (found {mb!r})")
        if mb and (mb < self.minibatch_size or mb % self.minibatch_size):
            raise bad(
                f"macrobatch_size must be >= minibatch_size={self.minibatch_size} and a "
                f"multiple of it (found {mb})"
            )
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 0:
            raise bad(f"max_tokens must be an int >= 0 (found {mt!r})")
        ns = self.num_sms
        if isinstance(ns, bool) or not isinstance(ns, int) or ns < 0:
            raise bad(f"num_sms must be an int >= 0, 0 for every SM (found {ns!r})")
        for name in ("capacity_factor", "wait_timeout_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
                raise bad(f"{name} must be a finite number (found {v!r})")
            if v <= 0:
                raise bad(f"{name} must be > 0 (found {v})")

    @property
    def macrobatch_rows(self) -> int:
        return self.macrobatch_size or self.minibatch_size

    def capacity_rows(
        self, num_tokens: int, num_topk: int, num_local_experts: int, num_ranks: int | None = None
    ) -> int:
        """Receive-buffer rows per rank: the routed rows the capacity factor allows plus the
        worst-case padding of every expert region, rounded up to the row tile. ``num_ranks``
        (None: not known) caps the factor: no rank receives more than every rank's rows, so a
        factor of ``num_ranks`` holds any routing (one rank: its own rows, whatever the
        factor)."""
        factor = self.capacity_factor if num_ranks is None else min(self.capacity_factor, num_ranks)
        rows = math.ceil(factor * num_tokens * num_topk)
        rows += num_local_experts * (self.row_tile - 1)
        return -(-rows // self.row_tile) * self.row_tile

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": CONFIG_FORMAT, "config": asdict(self)}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path | dict) -> MoKConfig:
        """Read ``{"format": "mok-config/1", "config": {...}}`` from a path, a JSON string or a
        dict. Unknown keys are an error that names them and lists the supported ones. Every
        malformed source (empty, of another type, a missing file or a directory, text that is
        not JSON or not a JSON object, fields of the wrong type or out of range) raises
        :class:`MoKConfigError`."""
        expect = (
            f"expected a path to a {CONFIG_FORMAT} JSON file, its JSON text or a dict as "
            "MoKConfig.to_dict returns"
        )
        if isinstance(source, dict):
            data, where = source, "config"
        elif isinstance(source, (str, Path)) or hasattr(source, "__fspath__"):
            is_text = isinstance(source, str)
            if is_text and not source.strip():
                raise MoKConfigError(f"config source is an empty or blank string; {expect}")
            if is_text and source.lstrip().startswith(("{", "[")):
                text, where = source, "config"
            else:
                try:
                    path = Path(source)
                    text, where = path.read_text(), f"config file {str(path)!r}"
                except IsADirectoryError:
                    raise MoKConfigError(
                        f"config path {str(source)!r} is a directory; {expect}"
                    ) from None
                except FileNotFoundError:
                    try:  # names no file: still JSON text if a scalar such as "5" or "null"
                        json.loads(source)
                    except (TypeError, ValueError, RecursionError):
                        raise MoKConfigError(
                            f"config file {str(source)!r} does not exist; {expect}"
                        ) from None
                    text, where = source, "config"
                except (OSError, TypeError, ValueError) as e:  # permissions, NUL, not UTF-8
                    why = getattr(e, "strerror", None) or str(e)
                    raise MoKConfigError(
                        f"cannot read config file {str(source)!r}: {why}; {expect}"
                    ) from None
            try:
                data = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise MoKConfigError(f"{where} is not valid JSON ({e}); {expect}") from None
        else:
            raise MoKConfigError(
                f"config source must be a path, a JSON string or a dict (found "
                f"{type(source).__name__} {source!r:.80}); {expect}"
            )
        if not isinstance(data, dict):
            raise MoKConfigError(
                f"{where} JSON must be an object (found {type(data).__name__}); {expect}"
            )
        fmt = data.get("format")
        if not isinstance(fmt, str) or fmt != CONFIG_FORMAT:
            raise MoKConfigError(
                f"config format {fmt!r:.80} is not supported; expected {CONFIG_FORMAT!r} "
                "(as written by `mok-sim tune --emit-config` or MoKConfig.to_json)"
            )
        # The simulator's tune output also carries what it was tuned for and its prediction.
        allowed = {"format", "config", "workload", "predicted_us", "breakdown"}
        extra = sorted((k for k in data if k not in allowed), key=repr)
        if extra:
            raise MoKConfigError(f"unknown top-level keys {extra}; supported: {sorted(allowed)}")
        body = data.get("config")
        if not isinstance(body, dict):
            raise MoKConfigError(
                f"config JSON needs a 'config' object with the MoKConfig fields (found "
                f"{type(body).__name__})"
            )
        names = [f.name for f in fields(cls)]
        unknown = sorted((k for k in body if k not in names), key=repr)
        if unknown:
            raise MoKConfigError(f"unknown MoKConfig keys {unknown}; supported: {', '.join(names)}")
        try:
            return cls(**body)
        except MoKConfigError:
            raise
        except (TypeError, ValueError, ArithmeticError) as e:  # e.g. an int too large for a float
            raise MoKConfigError(f"MoKConfig: invalid field value ({e}) in {body!r:.300}") from None
