"""``gateway_from_string``: the short strings a CLI flag or an environment variable carries."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asiento import FinalStep, UsageError
from asiento.gateways import (
    API_KEY_ENV,
    AnthropicGateway,
    OpenAIGateway,
    gateway_from_string,
)

from .fake_servers import Answer, FakeProvider
from .test_openai import SCRIPT, drive


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted provider on 127.0.0.1 speaking every wire format."""
    with FakeProvider(SCRIPT) as p:
        yield p


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Provider keys as a user's shell would have them (fake, never sent anywhere real)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)


@pytest.mark.parametrize(
    ("spec", "kind", "model", "api", "url"),
    [
        ("openai:gpt-4o", OpenAIGateway, "gpt-4o", "chat", "https://api.openai.com/v1/"),
        ("openai-responses:gpt-4.1", OpenAIGateway, "gpt-4.1", "responses", "https://api.openai.com/v1/"),
        ("openai:gpt-4o@http://127.0.0.1:8787/v1", OpenAIGateway, "gpt-4o", "chat", "http://127.0.0.1:8787/v1/"),
        ("anthropic:claude-sonnet-4-5", AnthropicGateway, "claude-sonnet-4-5", None, "https://api.anthropic.com"),
        ("anthropic:claude-x@http://127.0.0.1:8787", AnthropicGateway, "claude-x", None, "http://127.0.0.1:8787"),
        ("openai-compatible:llama3.1@http://localhost:11434/v1", OpenAIGateway, "llama3.1", "chat", "http://localhost:11434/v1/"),
        ("openai-compatible:org/m@v2@https://h.example/v1", OpenAIGateway, "org/m@v2", "chat", "https://h.example/v1/"),
    ],
)  # fmt: skip
async def test_each_form_makes_its_gateway(
    spec: str, kind: type, model: str, api: str | None, url: str
) -> None:
    """Each documented form picks the gateway, the model, the API and the base URL."""
    gateway = gateway_from_string(spec)
    try:
        assert isinstance(gateway, kind)
        assert gateway.model == model
        assert getattr(gateway, "api", None) == api
        assert str(gateway.client.base_url).rstrip("/") == url.rstrip("/")
    finally:
        await gateway.aclose()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt-4o", "unknown gateway"),
        ("mistral:large", "unknown gateway"),
        ("openai:", "unknown gateway"),
        ("openai-compatible:llama3", "needs the server's URL"),
    ],
)
def test_a_bad_string_is_a_usage_error_listing_the_forms(spec: str, message: str) -> None:
    """A string that fits no form is a UsageError that shows what would."""
    with pytest.raises(UsageError, match=message) as caught:
        gateway_from_string(spec)
    assert "MODEL@URL" in str(caught.value)


@pytest.mark.parametrize(
    ("spec", "variable"),
    [("openai:gpt-4o", "OPENAI_API_KEY"), ("anthropic:claude-x", "ANTHROPIC_API_KEY")],
)
def test_missing_credentials_are_a_usage_error_at_once(
    spec: str, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a key the gateway refuses to be made, naming the variable, before any request."""
    monkeypatch.delenv(variable)
    with pytest.raises(UsageError, match=variable):
        gateway_from_string(spec)


async def test_openai_compatible_never_sends_the_openai_key(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An openai-compatible server gets ASIENTO_API_KEY (or a dummy), never OPENAI_API_KEY."""
    async with gateway_from_string(f"openai-compatible:local-model@{provider.openai_url}") as gw:
        await drive(gw, tmp_path / "a.db")
    monkeypatch.setenv(API_KEY_ENV, "sk-local")
    async with gateway_from_string(f"openai-compatible:local-model@{provider.openai_url}") as gw:
        await drive(gw, tmp_path / "b.db")
    sent = {r.headers["authorization"] for r in provider.requests}
    assert sent == {"Bearer unused", "Bearer sk-local"}
    assert provider.requests[0].body["model"] == "local-model"


@pytest.mark.parametrize("kind", ["openai", "openai-responses", "anthropic"])
async def test_a_string_built_gateway_drives_a_run(
    provider: FakeProvider, tmp_path: Path, kind: str
) -> None:
    """A gateway made from a string (with @URL) drives a whole run with the provider's own key."""
    url = provider.anthropic_url if kind == "anthropic" else provider.openai_url
    async with gateway_from_string(f"{kind}:some-model@{url}", max_retries=0) as gw:
        steps = await drive(gw, tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    credentials = {
        r.headers.get("authorization", r.headers.get("x-api-key")) for r in provider.requests
    }
    secret = "sk-ant-secret" if kind == "anthropic" else "sk-openai-secret"
    assert {c.removeprefix("Bearer ") for c in credentials if c} == {secret}
    assert provider.problems == []


def test_importing_asiento_and_its_gateways_loads_no_sdk() -> None:
    """``import asiento.gateways`` works without importing the openai or anthropic SDKs."""
    code = (
        "import sys, asiento, asiento.gateways; "
        "print(sorted(m for m in ('openai', 'anthropic') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


DOCS = Path(__file__).resolve().parents[2] / "docs"
WEATHER = (Answer(calls=(("weather", {"city": "Madrid"}),)), Answer(text="Sunny in Madrid."))


def python_block(page: Path) -> str:
    """The first ```python block of a documentation page."""
    return page.read_text(encoding="utf-8").split("```python\n", 1)[1].split("```", 1)[0]


def run_doc(code: str, cwd: Path, env: dict[str, str]) -> str:
    """Run a documentation example in a fresh interpreter; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("page", ["openai", "anthropic", "openai-compatible"])
def test_the_provider_pages_examples_run(tmp_path: Path, page: str) -> None:
    """Each provider page's example runs as written, and a second run pays nothing."""
    with FakeProvider(WEATHER) as provider:
        env = {
            "OPENAI_BASE_URL": provider.openai_url,
            "OPENAI_API_KEY": "sk-test",
            "ANTHROPIC_BASE_URL": provider.anthropic_url,
            "ANTHROPIC_API_KEY": "sk-ant-test",
            "ASIENTO_GATEWAY": f"openai-compatible:llama3.1@{provider.openai_url}",
        }
        code = python_block(DOCS / "providers" / f"{page}.md")
        first = run_doc(code, tmp_path, env)
        second = run_doc(code, tmp_path, env)
    assert "Sunny in Madrid." in first
    assert "replayed=True" in second
    assert provider.billed() == 2
    assert provider.problems == []
