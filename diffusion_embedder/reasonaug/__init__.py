"""ReasonAug: build reasoning-retrieval triplets (concept -> problems -> checks -> BM25 hard negatives) with an
OpenAI-compatible LLM, resumably; and rebuild the shipped set offline from the real upstream files."""
