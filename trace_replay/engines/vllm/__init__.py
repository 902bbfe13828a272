"""vLLM in the caller's process: ``engine`` (the only module that imports vllm, with
``forcing``, its logits processors), ``invariance`` (batch-invariant mode), ``inprocess`` (a quiet,
restorable start).
"""
