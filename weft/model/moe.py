"""A mixture of experts in place of a layer's MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss).

The router scores every expert for each row (a small [E, hidden] matrix), takes the softmax over
the experts, keeps the `experts_per_token` most probable and, where the family says so
(`ModelConfig.norm_topk_prob`: Qwen3-MoE, Mixtral, gpt-oss), divides their weights by their
sum; Mixtral's and gpt-oss's softmax over the top-k logits is the same thing. A step then groups
its rows by expert: each expert routed to multiplies its own gate|up and down matrices once, for
all the rows routed to it, so only the active experts' weights are read (batch 1 reads its
`experts_per_token` experts and no more); their outputs, each scaled by its routing weight, are
put back in their rows' order with one scatter and each row's summed. Qwen2-MoE adds a shared
expert that every row runs, its output scaled by sigmoid(gate . x) with a gate vector of its own.
Each expert is an ordinary pair of `Linear` layers, so quantized experts run through the same
panels as dense matrices, or (`expert_weights="file"`) in the GGUF file's own blocks, read from its
pages (`WeightLayout.FILE`: no second copy of the experts, the same numbers). A row alone (batch 1)
whose experts are all in int8 dot panels of one kind (or all in the file's blocks) takes them in two
grouped products instead (`packed_linear_rows`, `file_linear_rows`: the row's gate|up rows, then
its down rows, each product one parallel region over every routed expert's panels, and gpt-oss's
biases added after, as a tile adds them), the same numbers in a few calls a layer where the
expert-by-expert loop made 40. A long prefill routes its rows in chunks (`MOE_CHUNK_BYTES`), so
that the grouped outputs of a 2,048-token step do not hold 2 x 134 MB at Qwen3-30B-A3B's shape.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from weft.config import ModelConfig
from weft.kernels import TorchKernels
from weft.model.layers import BFloat16Pairs, FileWeight, Linear, StepRows, WeightLayout

# A long prefill's experts in chunks of rows: each row's k outputs, grouped by expert and then put
# back in row order ([T * k, hidden] float32, twice), at most this many bytes.
MOE_CHUNK_BYTES = 32 << 20


class Expert(nn.Module):
    """One expert: SwiGLU over its own gate|up and down matrices, or gpt-oss's clamped SwiGLU
    (gate clamped above and up on both sides at `swiglu_limit`, then (up + 1) * gate *
    sigmoid(alpha * gate)) over matrices with biases."""

    def __init__(self, config: ModelConfig, kernels: TorchKernels, intermediate: int = 0) -> None:
        super().__init__()
        self.kernels = kernels
        hidden, bias = config.hidden_size, config.expert_bias
        inter = intermediate or config.moe_intermediate_size
        self.gate_up = Linear(hidden, 2 * inter, bias=bias)
        self.down = Linear(inter, hidden, bias=bias)
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor, rows: StepRows | None = None) -> torch.Tensor:  # [N, hidden]
        return self.down(self.activation(self.gate_up(x, rows)), rows)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2I] -> [N, I], row by row
        if self.limit is None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [N, I] each
        gate = gate.clamp(max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return up.clamp(-self.limit, self.limit).add_(1.0).mul_(glu)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, kernels: TorchKernels) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.router = Linear(config.hidden_size, config.num_experts, bias=config.expert_bias)
        self.experts = nn.ModuleList(Expert(config, kernels) for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = Expert(config, kernels, shared) if shared else None
        self.shared_gate = Linear(config.hidden_size, 1) if shared else None
        self._grouped: bool | None = None  # whether a row alone takes the grouped products (`_groups`)
        self._biases: tuple[torch.Tensor, torch.Tensor] | None = None  # every expert's, [E, 2I], [E, hidden]

    def forward(self, x: torch.Tensor | BFloat16Pairs, rows: StepRows | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]. `rows`: the step's prompt rows, which alone may take the BLAS
        GEMM in the router and the shared expert (a routed expert's rows are its own)."""
        assert isinstance(x, torch.Tensor)  # (its norm writes floats: `takes_pairs` is False)
        chunk = self.chunk_rows(x.shape[1])
        if x.shape[0] <= chunk:
            return self._rows(x, rows)
        out = x.new_empty(x.shape)  # [T, hidden]: a long prefill, `chunk` rows at a time
        for start in range(0, x.shape[0], chunk):
            stop = min(start + chunk, x.shape[0])
            out[start:stop] = self._rows(x[start:stop], None if rows is None else rows.slice(start, stop))
        return out

    def chunk_rows(self, hidden: int) -> int:
        """How many rows a step routes at a time: their grouped outputs within `MOE_CHUNK_BYTES`."""
        return max(1, MOE_CHUNK_BYTES // (2 * 4 * self.top_k * hidden))

    def _rows(self, x: torch.Tensor, rows: StepRows | None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, chosen = self.route(x, rows)  # [T, k] each
        num_rows, hidden = x.shape
        if num_rows == 1 and x.dtype == torch.float32 and self._groups():
            return self._one_row(x, weights, chosen, rows)
        flat = chosen.flatten()  # [T * k]: row t's choices at t * k ...
        order = torch.argsort(flat, stable=True)  # the choices grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        row_of = order // self.top_k  # [T * k] the row of each grouped choice
        scale = weights.flatten()[order]  # [T * k]
        grouped = x.new_empty(num_rows * self.top_k, hidden)  # [T * k, hidden] each choice's output
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows_e = row_of[start : start + count]  # [n]
                y = expert(x if num_rows == 1 else x.index_select(0, rows_e))  # [n, hidden]
                weight = scale[start : start + count, None].to(y.dtype)  # [n, 1]
                torch.mul(y, weight, out=grouped[start : start + count])
            start += count
        # each row's choices back in place, then summed: one scatter a step (an index_add_ per expert
        # cost tens of microseconds each, and milliseconds on a busy machine)
        placed = torch.empty_like(grouped).index_copy_(0, order, grouped)  # [T * k, hidden], row-major
        return self._shared_added(placed.view(num_rows, self.top_k, hidden).sum(1), x, rows)  # [T, hidden]

    def _shared_added(self, out: torch.Tensor, x: torch.Tensor, rows: StepRows | None) -> torch.Tensor:
        """out plus Qwen2-MoE's shared expert's output ([T, hidden], scaled by [T, 1]) where it has one."""
        if self.shared_expert is not None and self.shared_gate is not None:
            out.add_(self.shared_expert(x, rows).mul_(torch.sigmoid(self.shared_gate(x, rows))))
        return out

    def _one_row(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, rows: StepRows | None
    ) -> torch.Tensor:
        """One row's experts in two grouped products: [1, hidden] -> [1, hidden], summed as `forward`
        sums them."""
        experts = [cast(Expert, self.experts[e]) for e in chosen[0].tolist()]
        k, hidden = len(experts), x.shape[1]
        gate_up = _grouped_rows(x.expand(k, hidden), [e.gate_up for e in experts])  # [k, 2I]
        if self._biases is not None:  # (a tile adds its bias to the same sums: the same numbers)
            gate_up.add_(self._biases[0].index_select(0, chosen[0]))
        act = experts[0].activation(gate_up)  # [k, I]
        y = _grouped_rows(act, [e.down for e in experts])  # [k, hidden]
        if self._biases is not None:
            y.add_(self._biases[1].index_select(0, chosen[0]))
        out = y.mul_(weights[0, :, None].to(y.dtype)).view(1, k, hidden).sum(1)  # [1, hidden]
        return self._shared_added(out, x, rows)

    def _groups(self) -> bool:
        """Whether every expert's two matrices are int8 dot panels of one shape each (what
        `packed_linear_rows` multiplies), or the file's blocks of one shape and kinds each (what
        `file_linear_rows` multiplies), all with a bias or none: decided once, and their biases
        stacked."""
        if self._grouped is None:
            linears = [(e.gate_up, e.down) for e in cast(list[Expert], list(self.experts))]
            self._grouped = hasattr(torch.ops.weft, "packed_linear_rows") and all(
                len({_group_key(lin[i]) for lin in linears}) == 1
                and all(_dot_panels(lin[i]) or lin[i].file is not None for lin in linears)
                for i in (0, 1)
            )
            if self._grouped and linears[0][0].bias is not None:
                self._biases = cast(
                    tuple[torch.Tensor, torch.Tensor],
                    tuple(torch.stack([cast(torch.Tensor, lin[i].bias) for lin in linears]) for i in (0, 1)),
                )
        return self._grouped

    def route(
        self, x: torch.Tensor, rows: StepRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, k] float32, [T, k] int64
        """Each row's experts and their weights."""
        probs = torch.softmax(self.router(x, rows).float(), dim=-1)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def takes_pairs(self, num_tokens: int) -> bool:
        return False

    def stackable(self) -> bool:
        """Whether the fused decoder stack runs this layer's experts (weft/native/experts.cpp): routed
        experts all in int8 dot panels or all in the file's blocks, the router and the shared expert
        packed whole into panels."""
        experts = cast(list[Expert], list(self.experts))
        if not self._groups():
            return False
        whole = [lin for lin in (self.shared_gate,) if lin is not None]
        if self.shared_expert is not None:
            whole += [self.shared_expert.gate_up, self.shared_expert.down]
        panels = all(_dot_panels(e.gate_up) and _dot_panels(e.down) for e in experts)
        in_file = all(e.gate_up.file is not None and e.down.file is not None for e in experts)
        router = self.router.layout is WeightLayout.PANELS and self.router.parts is None
        return (
            (panels or in_file)
            and router
            and all(
                lin.layout is WeightLayout.PANELS and lin.parts is None and lin.bias is None for lin in whole
            )
        )

    def stack_tensors(self) -> list[torch.Tensor]:
        """Its weights in the stack's order: the router and its bias, the shared expert's gate, the
        experts' layout, their gate|up biases [E, 2I] and down biases [E, hidden] (each an empty
        tensor where there is none), every expert's gate|up (its parts), every expert's down."""
        empty = torch.empty(0)
        router_bias = empty if self.router.bias is None else self.router.bias
        gate = empty if self.shared_gate is None else self.shared_gate.weight
        layout, *matrices = _stacked_experts(cast(list[Expert], list(self.experts)))
        biases = self._biases or (empty, empty)
        return [self.router.weight, router_bias, gate, layout, *biases, *matrices]


def _stacked_experts(experts: list[Expert]) -> list[torch.Tensor]:
    """The experts' layout, then every expert's gate|up and every expert's down: their dot panels
    after an empty tensor, or their parts in the file after int64 [gate|up's parts, down's parts,
    each part's kind]."""
    files = [(e.gate_up.file, e.down.file) for e in experts]
    if any(up is None or down is None for up, down in files):
        return [torch.empty(0), *(e.gate_up.weight for e in experts), *(e.down.weight for e in experts)]
    up, down = cast(tuple[FileWeight, FileWeight], files[0])
    layout = torch.tensor([len(up.parts), len(down.parts), *up.kinds, *down.kinds], dtype=torch.int64)
    ups = [p for file, _ in files for p in cast(FileWeight, file).parts]
    downs = [p for _, file in files for p in cast(FileWeight, file).parts]
    return [layout, *ups, *downs]


def _grouped_rows(x: torch.Tensor, linears: list[Linear]) -> torch.Tensor:  # [k, in] -> [k, out]
    """Row i of x times linears[i], every matrix in one call: int8 dot panels (`packed_linear_rows`)
    or the file's blocks (`file_linear_rows`; each matrix's parts in order)."""
    first = linears[0].file
    if first is None:
        return torch.ops.weft.packed_linear_rows(x, [lin.weight for lin in linears], linears[0].out_features)
    parts = [part for lin in linears for part in cast(FileWeight, lin.file).parts]
    return torch.ops.weft.file_linear_rows(x, parts, list(first.kinds) * len(linears), len(first.parts))


def _group_key(linear: Linear) -> tuple[object, ...]:
    """What the matrices a grouped product takes share: their layout, shape, bias or none, and (the
    file's blocks) each part's rows and kind."""
    file = linear.file
    layout = () if file is None else (tuple(p.shape for p in file.parts), file.kinds)
    return (linear.weight.shape, linear.bias is None, *layout)


def _dot_panels(linear: Linear) -> bool:
    """Whether a Linear holds one matrix of int8 dot panels on the CPU (and a float32 bias or none)."""
    weight, bias = linear.weight, linear.bias
    return (
        linear.layout is WeightLayout.PANELS
        and linear.parts is None
        and (bias is None or bias.dtype == torch.float32)
        and weight.dtype == torch.int8
        and weight.dim() == 3
        and weight.device.type == "cpu"
    )
