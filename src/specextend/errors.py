"""Errors that reach the user as one clear line."""


class UserError(Exception):
    """Bad input or settings: the CLI prints one line and exits with status 2."""


class ContextLengthExceeded(UserError):
    """A prompt (or prompt + the tokens asked for) that cannot fit the model's context; the server
    answers it 400 with OpenAI's code `context_length_exceeded`, whichever of the two it is."""
