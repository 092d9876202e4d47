"""cactus-spec inside other engines (an interface layer: it imports ``core`` only)."""
