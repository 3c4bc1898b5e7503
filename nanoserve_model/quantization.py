"""Which FP8 weight format a checkpoint's linear layers hold, read from config.json's `quantization_config`
(or asked for with --quantization fp8), and which layers it leaves in the model dtype. Anything else is
refused here, in one line, before any weight is read.

Formats read:
  - Qwen's block FP8 (`quant_method: fp8`): e4m3 `weight` and a float32 `weight_scale_inv` per
    `weight_block_size` block (128 x 128 in every published checkpoint); `modules_to_not_convert` stay
    in the model dtype;
  - compressed-tensors (`quant_method: compressed-tensors`, format float-quantized) with 8-bit float
    weights per output channel (FP8_DYNAMIC) or per block (FP8_BLOCK), scales in `weight_scale`, and
    dynamic activations; `ignore` names the layers left alone (a `re:` entry is a regular expression);
  - --quantization fp8 on an unquantized checkpoint: every linear layer but the LM head is quantized as
    it loads, on the worker's device, per output channel (ONLINE_BLOCK): any shape and any
    tensor-parallel size splits on whole scales, and the kernels apply a row's scale once, after its
    sum (docs/fp8.md compares its accuracy with 128 x 128 blocks).
Activations are always quantized as they come (dynamic); static input scales are refused.
"""
import re
from dataclasses import dataclass

from nanoserve_kernels.fp8_reference import block_scales_shape

QUANTIZATION_METHODS = ("fp8",)  # the --quantization choices beside auto (vLLM's name)
PER_CHANNEL = None  # Fp8Scheme.block of per-output-channel scales
ONLINE_BLOCK = PER_CHANNEL  # --quantization fp8's scales (module docstring: why)


class QuantizationError(ValueError):
    """A quantization_config nanoserve cannot serve, said in terms of its fields."""


@dataclass(frozen=True)
class Fp8Scheme:
    method: str                         # the checkpoint's quant_method, or "fp8 (at load)"
    block: tuple[int, int] | None       # (rows, columns) a weight scale covers; PER_CHANNEL: a row
    scale_name: str                     # the checkpoint tensor beside each `weight`: its scales
    ignored: tuple[str, ...] = ()       # layers kept in the model dtype (names, or `re:` patterns)
    from_checkpoint: bool = True        # False: the checkpoint is unquantized and is quantized at load

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj) is left alone: an
        entry names it whole, or a leading or trailing run of its dotted parts (lm_head, mlp.gate)."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry) or module.startswith(entry + "."):
                return True
        return False

    def weight_block(self, columns: int) -> tuple[int, int]:
        """The block one scale covers in a weight of `columns` columns (per channel: a whole row)."""
        return (1, columns) if self.block is PER_CHANNEL else self.block

    def scales_shape(self, rows: int, columns: int) -> tuple[int, int]:
        """Shape of the scales of a [rows, columns] weight."""
        return block_scales_shape(rows, columns, self.weight_block(columns))

    def describe(self) -> str:
        """For the logs and the handshake: the method and its granularity."""
        grain = "per channel" if self.block is PER_CHANNEL else f"{self.block[0]}x{self.block[1]} blocks"
        return f"{self.method}, {grain}"


def serving_scheme(flag: str, checkpoint: Fp8Scheme | None) -> Fp8Scheme | None:
    """What --quantization `flag` serves: the checkpoint's own scheme when it has one ("auto", or fp8 of
    an FP8 checkpoint); fp8 of an unquantized checkpoint quantizes every linear layer but the LM head
    as it loads, per output channel (ONLINE_BLOCK)."""
    if flag not in ("auto",) + QUANTIZATION_METHODS:
        raise QuantizationError(f"--quantization {flag!r}: expected auto or one of {', '.join(QUANTIZATION_METHODS)}")
    if flag == "auto" or checkpoint is not None:
        return checkpoint
    return Fp8Scheme("fp8 (at load)", ONLINE_BLOCK, "weight_scale", ("lm_head",), from_checkpoint=False)


def read_quantization(raw: dict | None, where: str) -> Fp8Scheme | None:
    """The scheme of a config.json `quantization_config` (None: unquantized)."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise QuantizationError(f"{where}: `quantization_config` is not an object")
    method = raw.get("quant_method")
    if method == "fp8":
        return _qwen_fp8(raw, where)
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    raise QuantizationError(f"{where}: `quantization_config` quant_method {method!r} is not supported: nanoserve "
                            f"reads fp8 (block FP8, e4m3) and compressed-tensors FP8 checkpoints")


def _qwen_fp8(raw: dict, where: str) -> Fp8Scheme:
    field = f"{where}: `quantization_config`"
    if raw.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"{field} fmt {raw['fmt']!r} is not supported (only e4m3)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationError(f"{field} activation_scheme {raw['activation_scheme']!r} is not supported "
                                "(only dynamic: static input scales are not read)")
    block = raw.get("weight_block_size")
    if block is None:
        raise QuantizationError(f"{field} has no weight_block_size: per-tensor FP8 checkpoints are not supported")
    return Fp8Scheme("fp8", _block(block, f"{field} weight_block_size"), "weight_scale_inv",
                     tuple(raw.get("modules_to_not_convert") or ()))


def _compressed_tensors(raw: dict, where: str) -> Fp8Scheme:
    field = f"{where}: `quantization_config` (compressed-tensors)"
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(f"{field} has {len(groups)} config_groups; nanoserve reads one, targeting Linear")
    (name, group), = groups.items()
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("targets") != ["Linear"]:
        raise QuantizationError(f"{field} group {name} targets {group.get('targets')!r}; only ['Linear'] is read")
    if weights.get("type") != "float" or weights.get("num_bits") != 8 or group.get("format", raw.get("format")) \
            not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(f"{field} group {name}: weights of type {weights.get('type')!r} with "
                                f"{weights.get('num_bits')} bits; only 8-bit float (FP8) weights are read")
    if inputs and inputs.get("dynamic") is not True:
        raise QuantizationError(f"{field} group {name}: static input_activations scales are not read "
                                "(only dynamic activations, as FP8_DYNAMIC and FP8_BLOCK make them)")
    strategy = weights.get("strategy")
    if strategy == "channel":
        block = PER_CHANNEL
    elif strategy == "block":
        block = _block(weights.get("block_structure"), f"{field} group {name} block_structure")
    else:
        raise QuantizationError(f"{field} group {name}: weight strategy {strategy!r} is not supported "
                                "(channel or block)")
    return Fp8Scheme("compressed-tensors", block, "weight_scale", tuple(raw.get("ignore") or ()))


def _block(value, what: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise QuantizationError(f"{what} is {value!r}; expected two positive integers [rows, columns]")
    return value[0], value[1]
