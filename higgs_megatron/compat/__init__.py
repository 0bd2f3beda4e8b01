"""What this package asks of megatron-core and Megatron-LM beyond their public API, in one place.

* ``versions``: the supported megatron-core releases, and the check at start that refuses
  another (exit 2, naming it) unless ``--higgs-allow-untested-megatron`` is given;
* ``symbols``: every private symbol we override, swap or call, with the parameters we rely on,
  checked at start whatever the flags say: a release that renamed one fails there, naming it,
  not in the middle of a run;
* ``forks``: the fingerprints of the bodies, per release read, of the megatron-core methods we
  re-implement: a release whose body differs is refused like an untested one;
* ``rebind``: the one helper that rebinds a name on someone else's module or class and puts
  it back;
* ``checkpointing``: where megatron-core's checkpoint writer differs between the releases;
* ``groups``: where megatron-core holds its process groups, for the swap after a rebuild.

docs/megatron_compat.md lists the private symbols per release.
"""
