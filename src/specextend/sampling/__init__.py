"""What shapes a row of logits before a token is chosen: a grammar that constrains it (`grammar`),
repetition penalties (`penalties`), and one request's processing of both with its
log-probabilities (`logits_process`)."""
