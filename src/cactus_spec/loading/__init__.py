"""Getting models: names and files to loaded models (``models``), the model store of
checked GGUF and dense copies (``model_store``), the known models (``catalog``) and their
installation (``fetch``), which backend runs a model (``backend``), and how far a quantised
verifier is from its original (``divergence``). Imports the core and the backends."""
