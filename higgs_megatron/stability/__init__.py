"""Stability: fault injection, progress tracking and the watchdog, and progress alignment.

``faults`` parses and fires ``--inject-fault``; ``progress`` publishes each rank's iteration
and phase through the rendezvous store and watches it; ``alignment`` is the per-step vote by
which every rank keeps or drops a step together.
"""
