"""Policies: sync or async callables from a ToolCall to allow, deny or require_approval."""

from __future__ import annotations

import pytest

from asiento import Decision, ToolCall, UsageError, allow_all, require_approval_for
from asiento.policy import ask_policy

CALL = ToolCall(name="send_mail", arguments={"to": "ana"})


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("allow", Decision.ALLOW),
        ("deny", Decision.DENY),
        ("require_approval", Decision.REQUIRE_APPROVAL),
        (Decision.ALLOW, Decision.ALLOW),
        (Decision.DENY, Decision.DENY),
        (Decision.REQUIRE_APPROVAL, Decision.REQUIRE_APPROVAL),
    ],
)
async def test_sync_policy_answers(answer: str, expected: Decision) -> None:
    """A sync policy may answer with the string or the Decision."""
    decision = await ask_policy(lambda call: answer, CALL)
    assert decision is expected


async def test_async_policy_is_awaited() -> None:
    """An async policy is awaited, and sees the call it decides on."""
    seen: list[ToolCall] = []

    async def policy(call: ToolCall) -> str:
        seen.append(call)
        return "require_approval"

    assert await ask_policy(policy, CALL) is Decision.REQUIRE_APPROVAL
    assert seen == [CALL]


@pytest.mark.parametrize("answer", ["maybe", Decision.APPROVED, Decision.DENIED, None, True, ""])
async def test_non_decisions_are_refused(answer: object) -> None:
    """An answer a policy may not give is a UsageError naming the tool."""
    with pytest.raises(UsageError, match="send_mail"):
        await ask_policy(lambda call: answer, CALL)  # type: ignore[arg-type,return-value]


async def test_async_non_decision_is_refused() -> None:
    """An async policy answering something else is refused too."""

    async def policy(call: ToolCall) -> str:
        return "approved"

    with pytest.raises(UsageError, match="send_mail"):
        await ask_policy(policy, CALL)


async def test_require_approval_for_names() -> None:
    """require_approval_for asks a person for the named tools and allows the rest."""
    policy = require_approval_for("send_mail", "pay")
    assert await ask_policy(policy, CALL) is Decision.REQUIRE_APPROVAL
    assert await ask_policy(policy, ToolCall(name="pay")) is Decision.REQUIRE_APPROVAL
    assert await ask_policy(policy, ToolCall(name="read_file")) is Decision.ALLOW


async def test_allow_all_allows() -> None:
    """The default policy allows every call."""
    assert await ask_policy(allow_all, CALL) is Decision.ALLOW


class _ToolLike:
    name = "pay"


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ((["send_mail", "pay"],), r"each tool's name as an argument"),
        ((_ToolLike(),), r"require_approval_for\(\.\.\.\) takes non-empty str names"),
        (("",), r"non-empty str names, got ''"),
    ],
    ids=["a-list", "a-tool-object", "empty"],
)
def test_require_approval_for_refuses_what_would_match_no_call(
    given: tuple[object, ...], match: str
) -> None:
    """A tool object or a list would match no call's name: the tool would run with
    nobody's approval. Refused when the policy is made, naming what was given."""
    with pytest.raises(UsageError, match=match):
        require_approval_for(*given)  # type: ignore[arg-type]
