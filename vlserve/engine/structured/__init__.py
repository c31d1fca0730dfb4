"""Constrained decoding: structured-output specs compiled to llguidance grammars, one matcher per request,
token bitmasks for the sampler."""
