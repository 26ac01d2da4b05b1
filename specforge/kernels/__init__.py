"""Fused kernels (Triton) for the train step's hot spots, each beside its torch reference.

At the ground: a kernel module imports nothing of specforge, and Triton only when a kernel runs
(``soft_ce.available(device)`` says whether it can: CUDA with triton installed, or
``TRITON_INTERPRET=1`` with triton importable, which runs the kernels on CPU tensors in Python).
Every kernel has a torch twin with the same signature that the tests compare it with.

* ``soft_ce.py``      the row-wise part of the fused lm_head + soft cross-entropy (EAGLE-3's loss):
                      per row max, argmax, logsumexp, ``sum(p * z)`` and the logit gradient
                      ``softmax(z) - p``, tiled over the vocabulary; ``soft_ce_triton.py`` holds the kernel.
* ``losses.py``       every row loss of ``train.loss`` (forward KL, TV, LK's two forms, reverse KL, JSD) and
                      its logit gradient, in torch: the one place the draft's distillation losses are computed;
                      ``loss_rows_fused`` runs them as one kernel (``losses_triton.py``; ``kl_div``: soft_ce's).
"""
