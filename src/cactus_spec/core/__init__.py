"""The math: acceptance rules, chain verification, exact one-step laws, sampling, the method
registry and the decoding spec. Imports torch and nothing else of cactus-spec."""
