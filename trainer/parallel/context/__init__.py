"""Context parallel: the sequence of every sample split over the cp ranks.

    split.py    which tokens (and RoPE positions) each cp rank holds: contiguous, or zigzag for a causal ring
    ulysses.py  all-to-all sequence <-> heads around attention (DeepSpeed Ulysses)
    ring.py     K/V blocks passed round the cp group, partial softmaxes merged by log-sum-exp
    attention.py the attention cores a Llama block calls: one process (SDPA), Ulysses or ring

Everything here takes explicit process groups and tensors; no model, no manifest.
"""
