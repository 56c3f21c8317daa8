"""What each GPU holds under a parallel layout: ZeRO sharding and offload across data-parallel
ranks, tensor-parallel splits and pipeline stages."""

from __future__ import annotations

from pytest_vram.estimate.model import Layer, Model, Tensor, cdiv
from pytest_vram.estimate.options import QUANTIZED, EstimateError, Options
from pytest_vram.estimate.result import BREAKDOWN_KEYS, HOST_KEYS
from pytest_vram.estimate.terms import (
    act_bytes,
    count_optimizer_bytes,
    dtype_bytes,
    inference_layer_activations,
    kv_cache_bytes,
    optimizer_state,
    train_bytes_per_param,
    train_layer_activations,
    weight_bytes,
)

#: Bytes per GPU by term: (on the GPU, moved to host memory by offload).
Footprint = tuple[dict[str, int], dict[str, int]]


def model_states(weights: int, gradients: int, optimizer: int, o: Options) -> Footprint:
    """ZeRO sharding across ``dp`` and CPU offload; returns (on GPU, on host) per GPU."""

    def shard(nbytes: int, stage: int) -> int:
        return cdiv(nbytes, o.dp) if o.zero >= stage else nbytes

    gpu = {
        "weights": shard(weights, 3),
        "gradients": shard(gradients, 2),
        "optimizer": shard(optimizer, 1),
    }
    host = dict.fromkeys(HOST_KEYS, 0)
    moved: tuple[str, ...] = ()
    if o.offload == "optimizer":
        # ZeRO-Offload: the optimizer step runs on the CPU; from stage 2 on, the gradient
        # shards it consumes live there too.
        moved = ("optimizer", "gradients") if o.zero >= 2 else ("optimizer",)
    elif o.offload == "all":
        moved = HOST_KEYS
    for key in moved:
        host[key], gpu[key] = gpu[key], 0
    return gpu, host


def count_footprint(count: int, o: Options, notes: list[str]) -> Footprint:
    """The model states of ``count`` parameters of unknown shapes, split evenly across ranks.

    Appends to ``notes`` what a bare count cannot tell.
    """
    local = cdiv(count, o.tp * o.pp)
    if o.tp * o.pp > 1:
        notes.append("parameters are split evenly across tensor and pipeline ranks")
    if o.dtype in QUANTIZED:
        notes.append(
            f"every parameter counted at {o.dtype}; checkpoints usually keep embeddings and "
            "norms in 16-bit, which --config accounts for"
        )
    if o.train:
        b = train_bytes_per_param(o.dtype)
        weights, gradients = b * local, b * local
        optimizer = count_optimizer_bytes(local, o.dtype, o.optimizer)
        if o.optimizer == "adafactor":
            notes.append(
                "Adafactor's factored second moments (a row and a column per matrix) need "
                "the matrix shapes: pass --config (counted as 0 here)"
            )
    else:
        weights, gradients, optimizer = dtype_bytes(local, o.dtype), 0, 0
    gpu, host = model_states(weights, gradients, optimizer, o)
    notes.append(
        "activations, logits and KV cache need the model's shape: pass --config "
        "CONFIG.json (counted as 0 here)"
    )
    if o.zero == 3 and o.dp > 1:
        notes.append("the layer ZeRO-3 gathers around its compute needs --config (counted as 0)")
    return dict.fromkeys(BREAKDOWN_KEYS, 0) | gpu, host


def model_footprint(model: Model, o: Options, notes: list[str]) -> tuple[int, Footprint]:
    """The pipeline stage with the largest total, and what each of its GPUs holds."""
    for layer in {id(layer): layer for layer in model.layers}.values():
        if layer.heads % o.tp:
            raise EstimateError(
                f"tp ({o.tp}) must divide the number of attention heads ({layer.heads})"
            )
    best: tuple[int, int, Footprint] | None = None
    for index, (layers, extra) in enumerate(pipeline_stages(model, o.pp)):
        footprint = _stage_bytes(model, layers, extra, index, o)
        total = sum(footprint[0].values())
        if best is None or total > best[0]:
            best = (total, index, footprint)
    assert best is not None
    _, index, footprint = best
    if o.pp > 1:
        notes.append(
            f"figures are for pipeline stage {index}, the largest of {o.pp} "
            "(1F1B schedule: stage i keeps pp - i micro-batches of activations)"
        )
    return index, footprint


def pipeline_stages(model: Model, pp: int) -> list[tuple[list[Layer], list[Tensor]]]:
    """Layers and extra weights of each pipeline stage (earlier stages take the remainder)."""
    n = len(model.layers)
    if pp > n:
        raise EstimateError(f"pp ({pp}) is larger than the number of layers ({n})")
    base, extra = divmod(n, pp)
    stages: list[tuple[list[Layer], list[Tensor]]] = []
    start = 0
    for i in range(pp):
        size = base + (1 if i < extra else 0)
        tensors: list[Tensor] = []
        if i == 0:
            tensors.append(model.embedding)
        if i == pp - 1:
            tensors.append(model.final_norm)
            if model.lm_head is not None:
                tensors.append(model.lm_head)
            elif pp > 1:
                tensors.append(model.embedding)  # tied: the last stage holds its own copy
        stages.append((list(model.layers[start : start + size]), tensors))
        start += size
    return stages


def _stage_bytes(
    model: Model, layers: list[Layer], extra: list[Tensor], index: int, o: Options
) -> Footprint:
    tensors = [t for layer in layers for t in layer.tensors] + extra
    gpu, host = _stage_states(tensors, o)
    gpu["zero3_gathered"] = _zero3_gathered(layers, o)
    gpu |= _stage_activations(model, layers, index == o.pp - 1, index, o)
    return {key: gpu[key] for key in BREAKDOWN_KEYS}, host


def _stage_states(tensors: list[Tensor], o: Options) -> Footprint:
    """Weights, gradients and optimizer states of a stage's tensors, after ZeRO and offload."""
    if o.train:
        local = sum(t.local_numel(o.tp) for t in tensors)
        b = train_bytes_per_param(o.dtype)
        weights, gradients = b * local, b * local
        optimizer = 4 * local if o.dtype != "fp32" else 0  # fp32 master weights
        optimizer += sum(
            optimizer_state(t.local_shape(o.tp), t.copies, o.optimizer) for t in tensors
        )
    else:
        weights, gradients, optimizer = weight_bytes(tensors, o.tp, o.dtype), 0, 0
    return model_states(weights, gradients, optimizer, o)


def _zero3_gathered(layers: list[Layer], o: Options) -> int:
    # ZeRO-3 all-gathers a whole layer's weights before computing it (and, in training, holds
    # its full gradients until they are reduce-scattered), as FSDP does per wrapped layer.
    if o.zero != 3 or o.dp == 1 or not layers:
        return 0
    if o.train:
        b = train_bytes_per_param(o.dtype)
        return max(2 * b * sum(t.local_numel(o.tp) for t in layer.tensors) for layer in layers)
    return max(weight_bytes(layer.tensors, o.tp, o.dtype) for layer in layers)


def _stage_activations(
    model: Model, layers: list[Layer], last: bool, index: int, o: Options
) -> dict[str, int]:
    """Activations, logits and KV cache of one stage's GPU."""
    e = act_bytes(o.dtype)
    tok = o.batch * o.seq
    h = model.hidden
    activations = logits = kv_cache = 0
    if o.train and layers:
        inflight = o.pp - index
        terms = [
            train_layer_activations(layer, h, o.batch, o.seq, e, o.tp, o.attention)
            for layer in layers
        ]
        layer_input = cdiv(e * tok * h, o.tp)
        if o.recompute == "none":
            activations = inflight * sum(lin + quad for lin, quad in terms)
        elif o.recompute == "selective":
            # Recompute the attention core (the s^2 terms), one layer at a time in backward.
            activations = inflight * sum(lin for lin, _ in terms) + max(q for _, q in terms)
        else:
            # Keep each layer's input; the layer being back-propagated is rematerialised whole.
            activations = inflight * layer_input * len(layers) + max(lin + q for lin, q in terms)
        if last:
            activations += 2 * layer_input  # inputs of the final norm and of the output layer
            # The output layer's logits and the fp32 log-softmax the cross-entropy keeps for
            # backward; 16-bit logits also get an fp32 copy for the loss.
            fp32_copy = 4 if e < 4 else 0
            logits = (e + fp32_copy + 4) * tok * cdiv(model.vocab, o.tp)
    elif layers or last:
        if layers:
            activations = max(
                inference_layer_activations(layer, h, o.batch, o.seq, e, o.tp, o.attention)
                for layer in layers
            )
            kv_cache = sum(kv_cache_bytes(layer, o.batch, o.seq, e, o.tp) for layer in layers)
        if o.attention == "eager":
            activations += e * o.batch * o.seq * o.seq  # the 4-D causal mask
        if last:
            logits = e * tok * model.vocab  # a forward pass returns logits for every position
    return {"activations": activations, "logits": logits, "kv_cache": kv_cache}
