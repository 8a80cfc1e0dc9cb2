"""Speculative decoding of one sequence: the decoding loop (`decoder`: `ar`, and draft tree ->
one target verification) and its swappable parts: what is proposed (`propose`: the draft's tree,
`tree`, and the context's spans, `prompt_lookup`), how big (`sizing`, from the runtime's measured
costs), what the draft attends to (`draft_policy`: Cross-model Retrieval and the other caches,
over `draft_prefill`), the draft's head over part of the vocabulary (`draft_vocab`), and what the
target keeps (`verify`)."""
