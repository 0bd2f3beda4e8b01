"""What both front-ends run under, whichever launched the job: our pretrain script
(``training/``) and Megatron-LM's ``pretrain_gpt.py`` through the patches (``patches/``).

* ``exits``: the one usage-error type, the one table of exit statuses, and the function that
  turns how a run ended into its status;
* ``metrics``: Megatron-style log lines, the JSONL file and the callbacks, and the log window
  (step time, traffic);
* ``resilience``: stability around a step (faults, progress, the bounded decision,
  alignments, restarts);
* ``offload``: the memory manager attached to the run's optimizer, and its start-up lines.

The front-ends import from here; nothing here imports a front-end. What the launcher says
of the process (rank, world size, torchrun's per-attempt store) is ``higgs_megatron.launcher``,
below every layer that asks it.
"""
