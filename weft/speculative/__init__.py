"""Speculative decoding without a draft model: proposers that guess a sequence's next tokens from
text it already holds (issue #29). Today: the configuration and the n-gram prompt-lookup index;
verification in the engine is not built yet, so nothing here is reachable from `LLM`."""
