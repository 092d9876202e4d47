"""The lm-evaluation-harness model ``cactus-spec`` (``model``) and the conversion of its
model args and gen_kwargs (``args``). Only this package imports lm_eval."""
