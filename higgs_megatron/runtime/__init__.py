"""What both front-ends run under, whichever launched the job: our pretrain script
(``training/``) and Megatron-LM's ``pretrain_gpt.py`` through the patches (``patches/``).

* ``launcher``: what the launcher says of this process (rank, world size) and torchrun's
  per-attempt store;
* ``exits``: the one usage-error type, the one table of exit statuses, and the function that
  turns how a run ended into its status;
* ``metrics``: Megatron-style log lines, the JSONL file and the callbacks, and the log window
  (step time, traffic);
* ``resilience``: stability around a step (faults, progress, the bounded decision,
  alignments, restarts);
* ``offload``: the memory manager attached to the run's optimizer, and its start-up lines.

The front-ends import from here; nothing here imports a front-end.
"""
