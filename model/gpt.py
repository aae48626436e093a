"""A small GPT (model.name=gpt): causal self-attention through `scaled_dot_product_attention`, tied
embeddings. Its options: model.n_layer, n_head, n_embd, dropout, bias, attention, loss_chunks.

`forward(batch)` returns the *summed* cross-entropy over the batch's real targets (targets equal to
-100 are ignored). The loop divides by the target count of the whole optimizer step, so gradient
accumulation is exact even when micro-batches hold different numbers of targets.
With activation checkpointing (model.activation_checkpointing, through `set_activation_checkpointing`)
each block keeps only its input for backward and recomputes the rest (`torch.utils.checkpoint`,
non-reentrant): less memory, about one more forward of compute. `flops_per_token` gives the loop
its MFU, `generate` its text samples.
With model.loss_chunks=n the LM head and the cross-entropy run as one op over n chunks of the
micro-batch's tokens (`F.linear_cross_entropy`), so at most 1/n of its logits (tokens x
vocabulary) are held at once: the same summed loss, less memory (docs/performance.md).
With model.attention=flex the attention is torch's FlexAttention with a causal block mask, compiled:
its backward repeats bit for bit at full speed (python -m bench.attention), where SDPA's fused
kernels slow down under run.deterministic=true. It trains on CUDA only (torch has no FlexAttention
backward on the CPU) and has no attention dropout.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from loop.config.fields import opt
from loop.config.schema import ModelSection
from loop.data.bundle import Data
from loop.errors import BadInput


@dataclass
class GPTOptions(ModelSection):
    n_layer: int = opt(4, min=1)
    n_head: int = opt(4, min=1)
    n_embd: int = opt(128, min=1)
    dropout: float = opt(0.1, min=0.0, max=1.0)
    bias: bool = False
    attention: str = opt("sdpa", choices=("sdpa", "flex"))  # flex: FlexAttention (CUDA, no dropout)
    loss_chunks: int = opt(0, min=0)  # 0: the whole logits at once; n: head + loss in n chunks


def build_gpt(cfg: GPTOptions, data: Data) -> "GPT":
    with torch.device("cpu"):  # FSDP builds the model on the meta device: not the sample
        x = torch.as_tensor(data.train[0]["x"])  # one sample's input
    if x.dim() != 1 or x.is_floating_point() or x.is_complex():
        raise BadInput(f"config key model.name=gpt: expected data whose samples are token ids (x a row "
                       f"of integers); got x of shape {tuple(x.shape)} and dtype {x.dtype}.")
    if cfg.n_embd % cfg.n_head:
        raise BadInput(f"config key model.n_embd: expected a multiple of model.n_head="
                       f"{cfg.n_head}; got {cfg.n_embd}.")
    if cfg.attention == "flex" and cfg.dropout:
        raise BadInput(f"config key model.attention=flex: FlexAttention has no attention dropout; "
                       f"expected model.dropout=0 (got {cfg.dropout}), or model.attention=sdpa.")
    if cfg.loss_chunks and not hasattr(F, "linear_cross_entropy"):
        raise BadInput(f"config key model.loss_chunks={cfg.loss_chunks}: needs torch.nn.functional."
                       f"linear_cross_entropy, which torch {torch.__version__} does not have (torch 2.13 "
                       f"has it); expected 0, or a newer torch.")
    return GPT(data.vocab_size, data.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.bias,
               cfg.loss_chunks, cfg.attention == "flex")


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled into fused kernels (eager, it is a reference that writes every score
    matrix)."""
    return torch.compile(flex_attention)


def causal_mask(T: int, device: torch.device) -> BlockMask | None:
    """model.attention=flex's causal block mask. Off CUDA torch's FlexAttention has no backward (on
    the CPU it also refuses q, k and v cut from one tensor, as here): evaluation and sampling there
    take SDPA (None, the same attention); training stops."""
    if device.type == "cuda":
        return _causal_mask(T, device)
    if torch.is_grad_enabled():
        raise BadInput(f"config key model.attention=flex: trains on CUDA GPUs only (torch's "
                       f"FlexAttention has no backward on the CPU); expected model.attention=sdpa on "
                       f"{device.type} (the same weights), or train.device=cuda.")
    return None


@functools.cache
def _causal_mask(T: int, device: torch.device) -> BlockMask:
    # Normal tensors even when first built under inference mode (a caller's evaluation): training
    # reuses the mask, and inference tensors cannot be saved for backward.
    with torch.inference_mode(False), torch.no_grad():
        return create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device=device)


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, flex: bool = False):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.flex_attention = compiled_flex_attention() if flex else None
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: BlockMask | None) -> torch.Tensor:  # x: (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if mask is not None:  # model.attention=flex: causal by the mask, no attention dropout
            y = self.flex_attention(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(  # (B, nh, T, hs)
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, flex: bool = False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
        self.attn = SelfAttention(n_embd, n_head, dropout, bias, flex)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: BlockMask | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float, bias: bool, loss_chunks: int = 0, flex: bool = False):
        super().__init__()
        self.seq_len, self.activation_checkpointing, self.loss_chunks = seq_len, False, loss_chunks
        # Built eagerly, once per length and device (a compiled model takes it in as an input);
        # wrapped here, not at import, as the compiler's import takes a second.
        self.causal_mask = torch.compiler.disable(causal_mask) if flex else None
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias, flex) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def set_activation_checkpointing(self, on: bool) -> None:
        """The loop's model.activation_checkpointing switch (an optional method of a model)."""
        self.activation_checkpointing = on

    def flops_per_token(self) -> float:
        """Training FLOPs per token, for MFU (an optional method of a model): PaLM's count
        (Chowdhery et al. 2022, appendix B), as nanoGPT's `estimate_mfu` has it: 6*N + 12*L*H*Q*T.
        Forward + backward = 3 x forward, 2 FLOPs per weight per token in each matmul; attention
        adds QK^T and AV over the full context T (not halved for the causal mask). N counts every
        unique parameter (the tied wte/lm_head weight once: it stands for the lm_head matmul; the
        lookup itself does no FLOPs) but the position embedding. Recomputation (activation
        checkpointing) is not counted, by definition of MFU."""
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        attn = self.blocks[0].attn
        return float(6 * n + 12 * len(self.blocks) * attn.n_head * (attn.proj.in_features // attn.n_head)
                     * self.seq_len)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) -> (B, T, vocab)
        return self.lm_head(self.hidden(idx))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) -> (B, T, n_embd)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = self.causal_mask(idx.shape[1], idx.device) if self.causal_mask else None
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Keep only the block's input; recompute its insides in backward (same dropout
                # masks: the RNG state is saved and replayed), trading compute for memory.
                x = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return self.ln_f(x)

    def forward(self, batch: dict) -> torch.Tensor:
        h, y = self.hidden(batch["x"]), batch["y"].flatten()
        if self.loss_chunks:
            # In float32, autocast off: from bf16 inputs torch's op returns the sum in bf16 (1 to 4%
            # off over thousands of targets); in float32 it is the sum of the per-token losses. The
            # chunk size is set: torch's own pick for GPT-2's head re-reads the whole weight for
            # every 8 to 128 tokens (6x slower than no chunks on the CPU).
            rows = -(-y.numel() // self.loss_chunks)
            chunk = nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=rows)
            with torch.autocast(h.device.type, enabled=False):
                return F.linear_cross_entropy(h.flatten(0, 1).float(), self.lm_head.weight.float(), y,
                                              ignore_index=-100, reduction="sum", options=chunk)
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y, ignore_index=-100, reduction="sum")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int, generator: torch.Generator,
                 temperature: float = 0.8) -> torch.Tensor:
        """Sample n tokens after idx (1, T) with its own generator, so training RNG is untouched."""
        for _ in range(n):
            logits = self.logits(idx[:, -self.seq_len :])[:, -1].float()
            # The largest logit is made 0 before dividing, or a temperature of 1e-39 would overflow
            # (inf - inf in softmax: NaN, and multinomial raises). One below float32's smallest
            # normal, which a float32 division takes as 0 (0 / 0), is taken as that smallest normal.
            tiny = torch.finfo(torch.float32).tiny
            logits = (logits - logits.max(-1, keepdim=True).values) / max(temperature, tiny)
            nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
