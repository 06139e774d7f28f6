"""Settings precedence: init > environment > `.env` > settings file (TOML or YAML) > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cortex_worker.settings import SETTINGS_FILE_ENV, Settings

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No inherited CORTEX_* variables, and no `.env` from the working directory."""
    import os

    for key in list(os.environ):
        if key.startswith("CORTEX_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cortex.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    settings = Settings()
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.flower_port == 5555
    assert settings.flower_basic_auth is None
    assert settings.broker == settings.redis_url


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".yml"])
def test_the_file_beats_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     suffix: str) -> None:
    path = tmp_path / f"cortex{suffix}"
    if suffix == ".toml":
        path.write_text('redis_url = "redis://file:1/0"\nflower_port = 6000\n'
                        'http_allow_hosts = ["a.example"]\nflower_basic_auth = "ops:pw"\n')
    else:
        path.write_text("redis_url: redis://file:1/0\nflower_port: 6000\n"
                        "http_allow_hosts: [a.example]\nflower_basic_auth: ops:pw\n")
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(path))
    settings = Settings()
    assert settings.redis_url == "redis://file:1/0"
    assert settings.flower_port == 6000
    assert settings.http_allow_hosts == ["a.example"]
    assert settings.flower_basic_auth is not None
    assert settings.flower_basic_auth.get_secret_value() == "ops:pw"
    assert "ops:pw" not in repr(settings)  # a secret is never printed


def test_precedence_init_env_dotenv_file_default(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(_toml(tmp_path, (
        'redis_url = "redis://file:1/0"\nbroker_url = "amqp://file//"\n'
        'flower_port = 6001\nmax_parallel_actions = 7\nvisibility_timeout_s = 11\n'))))
    (tmp_path / ".env").write_text("CORTEX_BROKER_URL=amqp://dotenv//\nCORTEX_FLOWER_PORT=6002\n"
                                   "CORTEX_VISIBILITY_TIMEOUT_S=12\n")
    monkeypatch.setenv("CORTEX_FLOWER_PORT", "6003")
    monkeypatch.setenv("CORTEX_VISIBILITY_TIMEOUT_S", "13")
    settings = Settings(visibility_timeout_s=14)
    assert settings.visibility_timeout_s == 14          # init beats all
    assert settings.flower_port == 6003                 # env beats .env and file
    assert settings.broker_url == "amqp://dotenv//"     # .env beats file
    assert settings.max_parallel_actions == 7           # file beats defaults
    assert settings.redis_url == "redis://file:1/0"
    assert settings.event_retention_s == 7 * 24 * 3600  # default


def test_a_bad_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="no such file"):
        Settings()
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(_toml(tmp_path, 'redis_ur = "x"\n')))
    with pytest.raises(ValueError, match=r"unknown setting.*redis_ur"):
        Settings()
    other = tmp_path / "cortex.ini"
    other.write_text("x")
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(other))
    with pytest.raises(ValueError, match=r"\.toml, \.yaml"):
        Settings()


def test_flower_basic_auth_needs_user_and_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_FLOWER_BASIC_AUTH", "nopassword")
    with pytest.raises(ValidationError, match="user:password"):
        Settings()
    monkeypatch.setenv("CORTEX_FLOWER_BASIC_AUTH", "a:1,b:2")
    assert Settings().flower_basic_auth is not None
