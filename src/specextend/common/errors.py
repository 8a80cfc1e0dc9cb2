"""Errors that reach the user as one clear line."""


class UserError(Exception):
    """Bad input or settings: the CLI prints one line and exits with status 2."""


class FieldError(UserError):
    """Bad input in one field of a request: the message and the field it names (the server's 400
    names it as OpenAI's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(UserError):
    """A prompt (or prompt + the tokens asked for) that cannot fit the model's context; the server
    answers it 400 with OpenAI's code `context_length_exceeded`, whichever of the two it is."""


class PromptTooLong(ContextLengthExceeded):
    """A prompt longer than the model's context; `tokens` says how long (the page shows it)."""

    def __init__(self, message: str, tokens: int) -> None:
        super().__init__(message)
        self.tokens = tokens
