"""The built-in engine: a readable batched decode loop over a transformers causal LM.

Requests are placed in ``batch_size`` slots; a wave prefills its prompts together (left
padded), then decodes step by step with a KV cache. Each step the model's greedy choice is
overwritten by ``TraceReplayState.apply_trace`` and scored on the unmodified logits. When a
wave ends its slots are reused by the next traces (``add_request`` replaces a slot's trace).

With ``speculative`` the loop feeds ``k`` drafts per forward and keeps what
``apply_trace_to_verified`` accepts. Rows of one batch then advance by different amounts, so
rejected drafts stay in the KV cache but are masked out of attention for every later step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trace_replay.engines.base import ReplayRequest, TraceResult, collect_rows, score_tokens
from trace_replay.engines.drafts import ngram_drafts, parse_speculative
from trace_replay.engines.hf_backend import HFBackend
from trace_replay.engines.static_backend import StaticCacheBackend, supports
from trace_replay.models import load_model, resolve_dtype
from trace_replay.state import RequestState, TraceReplayState

__all__ = ["BACKENDS", "TorchEngine"]

BACKENDS = ("auto", "hf", "static")


class TorchEngine:
    """Forced decoding with transformers models, on CPU or CUDA.

    Parameters
    ----------
    model
        ``None`` (embedded model), a folder or a cached model name; or an already loaded
        transformers causal LM.
    dtype, device
        Cast and placement of the weights (defaults: float32, CUDA when available).
    batch_size
        Number of request slots (default 8 on CPU, 64 on CUDA).
    top_k
        Alternatives recorded per step.
    speculative
        ``None``, or ``{"method": "trace" | "ngram", "num_tokens": k}``.
    backend
        The forward pass: ``"hf"`` (the transformers model with a growing cache, any
        architecture), ``"static"`` (the model's own forward over a static KV cache,
        compiled CUDA graphs on GPU; Llama, Mistral, Qwen2/3 and Gemma families) or ``"auto"`` (static on CUDA when the model is supported, else hf).
    """

    name = "torch"

    def __init__(self, model=None, *, dtype=None, device=None, batch_size=None, top_k=5,
                 speculative=None, backend: str = "auto"):
        if isinstance(model, torch.nn.Module):
            self.lm = model.eval()
        else:
            self.lm = load_model(model, dtype=resolve_dtype(dtype), device=device)
        self.device = next(self.lm.parameters()).device
        self.dtype = next(self.lm.parameters()).dtype
        self.batch_size = batch_size or (64 if self.device.type == "cuda" else 8)
        self.top_k = top_k
        self.speculative = parse_speculative(speculative)
        self.max_model_len = getattr(self.lm.config, "max_position_embeddings", None)
        pad = self.lm.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)
        self.backend = self._make_backend(backend)
        self.req_states = RequestState(self.batch_size, self.device)
        self.trace_state = TraceReplayState(self.req_states)
        self._slots_in_use = 0
        self.drafted = 0
        self.accepted = 0

    def _make_backend(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown torch engine backend {backend!r}; choose one of "
                             f"{', '.join(BACKENDS)}")
        if backend == "auto":
            backend = "static" if self.device.type == "cuda" and supports(self.lm) else "hf"
        if backend == "hf":
            return HFBackend(self.lm, self.pad_id)
        max_query_len = 1 if self.speculative is None else self.speculative[1] + 1
        return StaticCacheBackend(self.lm, self.pad_id, max_query_len=max_query_len)

    def info(self) -> dict:
        info = {"engine_path": f"torch-decode[{self.backend.name}]",
                "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "batch_size": self.batch_size}
        if self.speculative is not None:
            method, k = self.speculative
            info["engine_path"] += f"+verify({method}, k={k})"
            info["speculative"] = {"method": method, "num_tokens": k}
            info["acceptance_rate"] = self.accepted / self.drafted if self.drafted else float("nan")
        return info

    @torch.inference_mode()
    def run(self, requests: Sequence[ReplayRequest]) -> list[TraceResult]:
        """Replay ``requests``; results come back in the order given."""
        # waves of similar length waste fewer steps on finished rows
        order = sorted(range(len(requests)), key=lambda i: requests[i].trace_len)
        results: dict[int, TraceResult] = {}
        for start in range(0, len(order), self.batch_size):
            wave = order[start:start + self.batch_size]
            for i, result in zip(wave, self._run_wave([requests[i] for i in wave])):
                results[i] = result
        return [results[i] for i in range(len(requests))]

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[tuple[list[int], list[float]]]:
        """Free generation (no trace) for recording: ``(token_ids, raw logprobs)`` per prompt.

        Greedy at ``temperature == 0``, else seeded sampling; each logprob is the chosen
        token's under the unmodified distribution. A row stops after emitting EOS.
        """
        generator = torch.Generator(device=self.device).manual_seed(seed)
        outputs = []
        for start in range(0, len(prompts), self.batch_size):
            wave = [ReplayRequest(str(i), tuple(p), ()) for i, p in
                    enumerate(prompts[start:start + self.batch_size])]
            idx_mapping = self._admit(wave)
            logits = self.backend.prefill([r.prompt_token_ids for r in wave], max_tokens)
            tokens, logprobs = [], []
            finished = torch.zeros(len(wave), dtype=torch.bool, device=self.device)
            for step in range(max_tokens):
                if temperature > 0:
                    probs = torch.softmax(logits.float() / temperature, dim=-1)
                    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                else:
                    sampled = logits.argmax(dim=-1)
                tokens.append(sampled)
                logprobs.append(score_tokens(logits, sampled, 0).logprob)
                if eos_token_id is not None:
                    finished |= sampled == eos_token_id
                if step == max_tokens - 1 or (step % 16 == 15 and bool(finished.all())):
                    break
                self.req_states.total_len[idx_mapping] += 1
                positions = (self.req_states.total_len[idx_mapping] - 1).long()[:, None]
                logits = self.backend.decode(sampled[:, None], positions)[:, -1]
            ids = torch.stack(tokens, 1).cpu().tolist()
            lps = torch.stack(logprobs, 1).double().cpu().tolist()
            for row_ids, row_lps in zip(ids, lps):
                end = (row_ids.index(eos_token_id) + 1 if eos_token_id in row_ids
                       else len(row_ids))
                outputs.append((row_ids[:end], row_lps[:end]))
        return outputs

    def _admit(self, wave: Sequence[ReplayRequest]) -> torch.Tensor:
        for slot, request in enumerate(wave):
            self.trace_state.add_request(slot, request.trace_token_ids)
        for slot in range(len(wave), self._slots_in_use):
            self.trace_state.remove_request(slot)
        self._slots_in_use = len(wave)
        self.trace_state.apply_staged_writes()
        prompt_len = torch.tensor([r.prompt_len for r in wave], dtype=torch.int32)
        self.req_states.prompt_len[: len(wave)] = prompt_len.to(self.device)
        self.req_states.total_len[: len(wave)] = prompt_len.to(self.device)
        return torch.arange(len(wave), device=self.device)

    def _run_wave(self, wave: Sequence[ReplayRequest]) -> list[TraceResult]:
        idx_mapping = self._admit(wave)
        longest = max(r.trace_len for r in wave)
        logits = self.backend.prefill([r.prompt_token_ids for r in wave], longest)
        if self.speculative is None:
            steps = self._decode(wave, idx_mapping, logits)
        else:
            steps = self._decode_verified(wave, idx_mapping, logits)
        return self._to_results(wave, steps)

    def _step(self, logits, idx_mapping):
        sampled = logits.argmax(dim=-1)
        self.trace_state.apply_trace(sampled, idx_mapping)
        self.req_states.total_len[idx_mapping] += 1
        return sampled, score_tokens(logits, sampled, self.top_k)

    def _decode(self, wave, idx_mapping, logits):
        num_steps = max(r.trace_len for r in wave)
        steps = []
        for step in range(num_steps):
            # sample, force the trace token, score it on the unmodified logits
            sampled, scores = self._step(logits, idx_mapping)
            steps.append((scores, sampled))
            if step == num_steps - 1:
                break
            # feed the forced token at its position (total_len - 1)
            positions = (self.req_states.total_len[idx_mapping] - 1).long()[:, None]
            logits = self.backend.decode(sampled[:, None], positions)[:, -1]
        return steps, torch.ones((len(steps), len(wave)), dtype=torch.int32)

    def _decode_verified(self, wave, idx_mapping, logits):
        method, k = self.speculative
        batch = len(wave)
        trace_len = torch.tensor([r.trace_len for r in wave], device=self.device)
        sampled, scores = self._step(logits, idx_mapping)
        steps = [(scores, sampled)]
        counts = [torch.ones(batch, dtype=torch.int32, device=self.device)]
        context = self._context(wave, sampled)
        last = sampled
        cu_num_logits = torch.arange(batch + 1, device=self.device, dtype=torch.int32) * (k + 1)
        offsets = torch.arange(k + 1, device=self.device)
        # trace drafts are always accepted: every forward commits k + 1 tokens per row
        left = max(r.trace_len for r in wave) - 1
        remaining = -(-left // (k + 1)) if method == "trace" else left
        drafted = accepted = torch.zeros((), dtype=torch.long, device=self.device)
        while remaining > 0:
            total_len = self.req_states.total_len[idx_mapping].long()
            done = total_len - self.req_states.prompt_len[idx_mapping].long()
            if method == "trace":
                drafts = self.trace_state.peek(idx_mapping, k)
            else:
                drafts = ngram_drafts(context, total_len, k)
            fed = torch.cat([last[:, None], drafts], dim=1)  # [B, k+1]
            positions = total_len[:, None] - 1 + offsets
            logits = self.backend.decode(fed, positions)
            verified = logits.argmax(dim=-1)  # [B, k+1]
            num_sampled = torch.zeros(batch, dtype=torch.int32, device=self.device)
            # the draft checked by logits row j is fed.flatten()[j + 1]
            self.trace_state.apply_trace_to_verified(
                verified, num_sampled, fed.flatten(), cu_num_logits, idx_mapping)
            self.req_states.total_len[idx_mapping] += num_sampled
            keep = offsets[None, :] < num_sampled[:, None]
            self.backend.keep(keep)  # rejected drafts never attended again
            scores = score_tokens(logits.flatten(0, 1), verified.flatten(), self.top_k)
            steps.append((scores, verified.flatten()))
            counts.append(num_sampled)
            active = done < trace_len
            drafted = drafted + (torch.minimum(trace_len - done - 1, torch.full_like(done, k))
                                 .clamp(min=0) * active).sum()
            accepted = accepted + ((num_sampled.long() - 1).clamp(min=0) * active).sum()
            last = verified.gather(1, (num_sampled.long() - 1).clamp(min=0)[:, None]).squeeze(1)
            context.scatter_(1, torch.where(keep, total_len[:, None] + offsets,
                                            context.shape[1] - 1), verified)
            remaining -= 1
            if method != "trace":
                # acceptance is data-dependent: one host read per forward (not per token)
                remaining = int((trace_len - (self.req_states.total_len[idx_mapping]
                                 - self.req_states.prompt_len[idx_mapping])).max().item())
        self.drafted += int(drafted)
        self.accepted += int(accepted)
        return steps, torch.stack(counts)

    def _context(self, wave, first_tokens):
        """Committed tokens per row (prompt + emitted), for n-gram lookup; last column is scratch."""
        width = max(r.prompt_len + r.trace_len for r in wave) + 1
        context = torch.full((len(wave), width), -1, dtype=torch.long)
        for row, request in enumerate(wave):
            context[row, : request.prompt_len] = torch.tensor(request.prompt_token_ids)
        context = context.to(self.device)
        plen = torch.tensor([r.prompt_len for r in wave], device=self.device)
        context.scatter_(1, plen[:, None], first_tokens[:, None])
        return context

    def _to_results(self, wave, steps_and_counts) -> list[TraceResult]:
        steps, counts = steps_and_counts
        # one host transfer for the whole wave
        host = collect_rows(
            type(steps[0][0])(*(torch.cat(parts) for parts in zip(*(s for s, _ in steps)))),
            torch.cat([tokens for _, tokens in steps]),
        )
        counts = counts.cpu().numpy()
        batch = len(wave)
        bounds = np.cumsum([0] + [len(tokens) for _, tokens in steps])
        per_row: list[list[np.ndarray]] = [[] for _ in range(batch)]
        for it in range(len(steps)):
            width = (bounds[it + 1] - bounds[it]) // batch
            for row in range(batch):
                start = bounds[it] + row * width
                per_row[row].append(np.arange(start, start + counts[it, row]))
        results = []
        for row, request in enumerate(wave):
            take = np.concatenate(per_row[row])[: request.trace_len]
            results.append(TraceResult(trace_id=request.trace_id, prompt_len=request.prompt_len,
                                       **{name: values[take] for name, values in host.items()}))
        return results
