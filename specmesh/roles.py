"""Facts about the two model roles, in one table: every service, launcher and test reads them here."""

from __future__ import annotations

from dataclasses import dataclass

# Most draft tokens one round may carry: the client's num_speculative_tokens, the draft's
# Propose/PreDraft num_tokens and extra branches, and the target's Verify all stop here.
MAX_DRAFT_TOKENS = 32
# Most tokens a target-only Verify decodes after its next token (VerifyRequest.decode_ahead): no more than
# a round of drafts commits, so the KV room a session reserves for a round's drafts covers them too.
MAX_DECODE_AHEAD = MAX_DRAFT_TOKENS
# The first start of a model service may assemble and convert the embedded models.
START_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Role:
    name: str  # "draft" or "target"
    # Seeds the role's sampling generators apart from the other role's under the same request seed.
    generator_salt: int
    default_model: str  # embedded alias used when no model is named
    # While streams decode, a step with a prefill chunk may cost at most this many times the
    # decode rows alone (--prefill-slowdown). The target's step is most of a stream's round, so
    # a chunk there shows in every stream's inter-token time at nearly its full cost; a draft
    # step is a small part of a round, so a draft's chunk may be dearer (figures: docs/design/tuning.md).
    prefill_slowdown: float
    # GOMP_SPINCOUNT its processes start with (None: libgomp's own), so that beside the other role
    # on the same cores its idle OpenMP threads give the cores back soon (specmesh.loading.openmp).
    openmp_spin_count: str | None = None


TARGET = Role("target", generator_salt=0, default_model="qwen2.5-coder-1.5b", prefill_slowdown=2.0)
DRAFT = Role("draft", generator_salt=1, default_model="qwen2.5-coder-0.5b", prefill_slowdown=6.0,
             openmp_spin_count="2000")
ROLES = {role.name: role for role in (TARGET, DRAFT)}


def role(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise ValueError(f"role must be one of {sorted(ROLES)}, not {name!r}") from None
