"""Structured outputs: a request's text constrained to a JSON schema, a regex, a choice or a grammar.

The request side, StructuredOutput, is chunkwise.engine.datatypes.structured_output (free of torch and
llguidance); compiler.py turns specs into llguidance
matchers for one engine's tokenizer; state.py holds the runner's per-request matchers and builds each
step's token mask. Import the last two from their modules (they need llguidance and torch).
"""

from chunkwise.engine.datatypes.structured_output import StructuredOutput

__all__ = ["StructuredOutput"]
