"""A tiny Megatron-core GPT with our MoE in every second MLP, trained one step under Megatron's
own layouts (its parallel_state, TP layers, DDP, schedules, finalize_model_grads) and compared
with the same model in one process. Run by tests/adapters/test_megatron.py in one 2-rank launch.

Legend: s sequence, b micro-batch size, h hidden size, E experts, F expert hidden dim,
n microbatches in the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

S, B, H, HEADS, FF, VOCAB, E, K, LAYERS, N_MICRO = 8, 2, 16, 2, 24, 64, 4, 2, 4, 2
AUX = 0.05  # aux-loss coefficient: the router losses must reach the gradients
RTOL = 1e-5  # fp32; absolute allowance RTOL * max|reference| per tensor, at least ATOL_MIN
# fp32 rounding of a gradient that is a sum cancelling to almost nothing: under global BASE with
# no aux loss the router weight's gradient peaks at 2.9e-6, and summing its terms over two ranks
# instead of one process moved entries by up to 8.1e-11 (2.8e-5 of that peak, 2.9e-11 allowed);
# a gradient wrong by a dropped or doubled reduction is off by the order of the gradient itself
ATOL_MIN = 1e-9


def _transformer_config(*, tp: int = 1, pp: int = 1, sp: bool = False, aux: float = AUX, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # recompute: Megatron's full activation recompute of every layer (its reentrant checkpoint),
    # so each MoE forward runs again inside the backward and attaches its router losses there
    checkpointing = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        **(checkpointing if recompute else {}),
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        ffn_hidden_size=FF,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=E,  # read by Megatron's schedules: they then set the aux-loss scale
        moe_router_topk=K,
        moe_ffn_hidden_size=FF,
        moe_aux_loss_coeff=aux,
        # the fused kernels Megatron would pick need CUDA; these are its unfused paths
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )


def build_gpt(config, *, base: bool = False):
    """This pipeline stage's part of the GPT: local spec, our MoE in layers 2 and 4 (softmax
    top-2, or ``base``: top-1 BASE balanced over the expert-parallel group)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from moe.adapters.megatron import moe_config_from_megatron, moe_module_spec
    from tests.adapters.megatron_cpu import LayerNorm

    dense, moe = get_gpt_layer_local_spec(), get_gpt_layer_local_spec()
    if base:
        cfg = moe_config_from_megatron(
            config, backend="torch", router="base", top_k=1, combine="sigmoid_residual", router_options={}
        )
        moe.submodules.mlp = moe_module_spec(cfg, global_base=True)
    else:
        moe.submodules.mlp = moe_module_spec(moe_config_from_megatron(config, backend="torch"))
    for spec in (dense, moe):
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = LayerNorm
    layers = [moe if i % 2 else dense for i in range(LAYERS)]
    offset = get_transformer_layer_offset(config)
    spec = TransformerBlockSubmodules(
        layer_specs=layers[offset : offset + get_num_layers_to_build(config)], layer_norm=LayerNorm
    )
    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=S,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def batches() -> list[torch.Tensor]:
    """The step's n microbatches of token ids, (b, s + 1) each (inputs and shifted labels)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (B, S + 1), generator=g) for _ in range(N_MICRO)]


def _forward_step(data_iterator, model):
    ids = next(data_iterator)
    # the causal mask passed in (True: masked out): Megatron's default one is made on "cuda"
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
    pos = torch.arange(S).expand(ids.shape[0], S)
    out = model(ids[:, :-1], pos, mask, labels=ids[:, 1:])  # [b, s] losses on the last stage

    def loss_func(losses):
        # reported: each sequence's mean loss (b,), compared sequence by sequence
        return losses.float().mean(), {"lm loss": losses.detach().float().mean(dim=1)}

    return out, loss_func


def train_step(model, micro: list[torch.Tensor]) -> list[torch.Tensor]:
    """One forward/backward over ``micro`` with Megatron's schedule; each microbatch's
    per-sequence losses on the last stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=S,
        micro_batch_size=B,
        forward_only=False,
    )
    return [d["lm loss"] for d in out]


def _one_process(aux: float, *, base: bool = False, micro: list[torch.Tensor] | None = None):
    model = build_gpt(_transformer_config(aux=aux), base=base)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = train_step(model, micro or batches())
    return weights, losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference():
    """The one-process run: tp = pp = ep = 1, all n microbatches; no collective runs (the
    data-parallel ranks of the 2-rank world are not synchronised: no DDP here). Returns, by
    aux-loss coefficient (`AUX` and 0), the full weights, the losses and the gradients by name;
    under "base" the same for the BASE model on all the step's sequences in one microbatch
    (what BASE balanced over the whole expert-parallel group sees).

    Checks that the router losses reach the router gradients through Megatron's aux-loss
    scaler, whose scale Megatron's schedule sets (1 / n): without them (coefficient 0) the
    gradients differ by far more than the tolerance of the layout comparisons."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    parallel_state.initialize_model_parallel(1, 1)
    try:
        ref = _one_process(AUX)
        assert MoEAuxLossAutoScaler.main_loss_backward_scale.item() == 1 / N_MICRO
        ref0 = _one_process(0.0)
        base = _one_process(0.0, base=True, micro=[torch.cat(batches())])
    finally:
        parallel_state.destroy_model_parallel()
    torch.testing.assert_close(torch.cat(ref0[1]), torch.cat(ref[1]), rtol=0, atol=0)  # lm loss only
    for name in ("decoder.layers.1.mlp.moe.router.weight", "decoder.layers.3.mlp.moe.router.weight"):
        diff = (ref[2][name] - ref0[2][name]).abs().max()
        assert diff > 100 * RTOL * ref[2][name].abs().max(), f"{name}: the aux loss changed its grad by {diff}"
    return {AUX: ref, 0.0: ref0, "base": base}


def _global_name(model, name: str) -> str:
    """A stage's parameter name -> the one-process name (pipeline stages number their layers
    from 0; ``layer_number`` is the global, 1-based one)."""
    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers.") :].split(".", 1)
    return f"decoder.layers.{model.decoder.layers[int(i)].layer_number - 1}.{rest}"


def _shard(name: str, param, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the one-process tensor ``full`` for ``param``: Megatron's TP layers
    split dim ``partition_dim`` (0 for ColumnParallel, 1 for RowParallel) with the gated fc1
    holding its rank's block of the gate and of the up projection; our expert shards hold
    experts [r*E/ep, (r+1)*E/ep) and, under etp, their block of F."""
    from megatron.core import parallel_state as ps

    if getattr(param, "allreduce", True) is False:  # one of our expert shards
        ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        full = full.chunk(ep, dim=0)[ps.get_expert_model_parallel_rank()]
        hidden = 1 if name.endswith("w2") else 2
        return full.chunk(etp, dim=hidden)[ps.get_expert_tensor_parallel_rank()]
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if name.endswith("mlp.linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        return torch.cat([half.chunk(tp, dim=0)[rank] for half in full.chunk(2, dim=0)])
    return full.chunk(tp, dim=param.partition_dim)[rank]


def run_layout(
    refs,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    sp: bool = False,
    aux: float = AUX,
    base: bool = False,
    recompute: bool = False,
):
    """Train one step under the layout, check the losses and every gradient against the
    one-process run ``refs[aux]`` (``refs["base"]`` for BASE); returns how many tensors were
    compared."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    weights, ref_losses, ref_grads = refs["base" if base else aux]  # the BASE run has no aux loss
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        config = _transformer_config(tp=tp, pp=pp, sp=sp, aux=aux, recompute=recompute)
        model = build_gpt(config, base=base)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_shard(name, p, weights[_global_name(model, name)]))
        config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        micro = batches()[dp_rank::dp]  # data parallel: rank r takes every dp-th microbatch
        losses = train_step(ddp, micro)
        label = f"tp={tp} pp={pp} ep={ep} etp={etp} sp={sp} aux={aux} base={base} recompute={recompute}"
        if parallel_state.is_pipeline_last_stage():
            per_seq = torch.cat(ref_losses).view(N_MICRO, B)  # the step's sequences, microbatch by microbatch
            want, got = per_seq[dp_rank::dp].reshape(-1), torch.cat(losses)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0, msg=f"{label}: losses {got} {want}")
        shards = [p for p in model.parameters() if getattr(p, "allreduce", True) is False]
        assert all(p.shape[0] == E // ep for p in shards) and (len(shards) > 0) == (ep * (etp or tp) > 1), label
        checked = 0
        for name, p in model.named_parameters():
            want = _shard(name, p, ref_grads[_global_name(model, name)])
            got = p.main_grad
            torch.testing.assert_close(
                got,
                want,
                rtol=RTOL,
                atol=max(RTOL * want.abs().max().item(), ATOL_MIN),
                msg=lambda m, n=name: f"{label}: {n}: {m}",
            )
            checked += 1
        return checked
    finally:
        parallel_state.destroy_model_parallel()


LAYOUTS = [
    dict(tp=2, etp=1),  # TP2, experts replicated (Megatron without SP routes the same tokens on every tp rank)
    dict(tp=2, sp=True),  # TP2 + SP, Megatron's default etp = tp: experts' F split over the tp ranks
    dict(tp=2, sp=True, etp=1),  # TP2 + SP, experts replicated: gathered from the SP region
    dict(pp=2),  # PP2, 1F1B over two microbatches
    dict(ep=2),  # EP2 over the two data-parallel ranks
    # EP2 over the two tp ranks, each routing its own s/tp tokens under SP. Without a router
    # loss: that one is computed over each rank's part of the sequence, not over all of it
    dict(tp=2, sp=True, etp=1, ep=2, aux=0.0),
    # EP2 with BASE balanced over the ep group: one assignment of both ranks' tokens, as one
    # process balances them in one microbatch
    dict(ep=2, base=True, aux=0.0),
    # TP2 + SP, experts split over etp, with Megatron's full activation recompute: the router
    # losses of the re-run forwards reach the gradients once
    dict(tp=2, sp=True, recompute=True),
]


def groups_and_bad_layouts() -> None:
    """Our MoE takes Megatron's groups from a ``pg_collection`` (newer Megatron passes one):
    it builds and runs with parallel_state torn down. Layouts it cannot run raise on every
    rank alike, before any collective, naming the setting."""
    import pytest
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from moe.adapters.megatron import MegatronMoE, moe_config_from_megatron

    config = _transformer_config()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "ep", "expt_tp", "tp_ep"])
    with pytest.raises(ValueError, match="num_experts=3 must be divisible by Megatron's expert_model_parallel_size=2"):
        MegatronMoE(config, moe_config_from_megatron(config, num_experts=3))
    parallel_state.destroy_model_parallel()
    layer = MegatronMoE(config, moe_config_from_megatron(config, backend="torch"), pg_collection=pg)
    assert layer.moe.experts.w1.shape[0] == E // 2 and layer.moe.parallel is not None
    y, bias = layer(torch.randn(S, B, H))
    assert bias is None and y.shape == (S, B, H)
    parallel_state.initialize_model_parallel(2, 1)  # Megatron's default etp = tp = 2, without SP
    try:
        with pytest.raises(ValueError, match="tensor_model_parallel_size=2 needs sequence_parallel=True"):
            MegatronMoE(_transformer_config(tp=2), moe_config_from_megatron(config))
        sp = _transformer_config(tp=2, sp=True)
        with pytest.raises(
            ValueError, match="hidden_dim=25 must be divisible by Megatron's expert_tensor_parallel_size=2"
        ):
            MegatronMoE(sp, moe_config_from_megatron(sp, hidden_dim=25))
    finally:
        parallel_state.destroy_model_parallel()


_REFERENCE: list = []  # the one-process run, made once per process by the first layout


def check_layout(i: int) -> None:
    """Layout ``LAYOUTS[i]`` against the one-process run."""
    if not _REFERENCE:
        _REFERENCE.append(reference())
    assert run_layout(_REFERENCE[0], **LAYOUTS[i]) > 0


def layout_id(layout: dict) -> str:
    return "-".join(f"{k}{v:g}" for k, v in layout.items())
