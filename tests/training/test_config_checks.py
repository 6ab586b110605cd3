"""AveragerConfig refuses a wrong type or value when it is made, naming the field, instead
of a TypeError deep inside a later step (a new-user trial: ``clock="now"``,
``client_mode="false"`` silently a client, ``gather_window=True`` and ``1e-9`` accepted,
``staleness_decay="0.5"`` a bare comparison error)."""

from __future__ import annotations

import numpy as np
import pytest

from peer import run_in_background
from training import Averager, AveragerConfig

REAL_FIELDS = [
    "staleness_decay",
    "gather_window",
    "join_timeout",
    "stall_timeout",
    "result_share",
    "default_timeout",
    "bandwidth",
]


@pytest.mark.parametrize("value", ["0.5", None, True, [1.0]])
@pytest.mark.parametrize("name", REAL_FIELDS)
def test_a_real_field_of_another_type_is_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"AveragerConfig\.{name} must be a number, got"):
        AveragerConfig(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", REAL_FIELDS)
def test_numpy_and_integer_reals_are_kept_as_floats(name: str) -> None:
    value = 0.5 if name in ("staleness_decay", "result_share") else 3
    config = AveragerConfig(**{name: np.float64(value)})  # type: ignore[arg-type]
    assert type(getattr(config, name)) is float and getattr(config, name) == value


@pytest.mark.parametrize("window", [1e-9, 0.049])
def test_a_gather_window_too_short_to_gather_is_refused(window: float) -> None:
    with pytest.raises(ValueError, match=r"gather_window must be at least 0\.05 s"):
        AveragerConfig(gather_window=window)
    assert AveragerConfig(gather_window=0.05).gather_window == 0.05


@pytest.mark.parametrize("value", ["false", 1, 0, "yes"])
def test_client_mode_must_be_a_bool_or_none(value: object) -> None:
    with pytest.raises(ValueError, match="client_mode must be True, False or None"):
        AveragerConfig(client_mode=value)  # type: ignore[arg-type]
    for ok in (True, False, None):
        assert AveragerConfig(client_mode=ok).client_mode is ok


@pytest.mark.parametrize("value", ["now", 5])
def test_a_clock_that_is_not_callable_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="clock must be a function returning unix time"):
        AveragerConfig(clock=value)  # type: ignore[arg-type]


def test_codec_params_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="codec_params must be a dict"):
        AveragerConfig(codec_params=[("fraction", 0.1)])  # type: ignore[arg-type]


def test_a_clock_that_returns_no_number_says_so_from_step() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(4)
    with run_in_background() as node:  # (the step's timeout bounds it)
        averager = Averager(
            node,
            "cfg/clock",
            [tensor],
            config=AveragerConfig(clock=lambda: "x"),  # type: ignore[arg-type,return-value]
        )
        with pytest.raises(TypeError, match=r"AveragerConfig\.clock returned 'x'"):
            averager.step_blocking(timeout=5)
        averager.close()


def test_client_mode_false_on_a_node_that_accepts_no_connections_is_refused() -> None:
    """It was silently overridden: the peer, unable to take connections, stayed a sender."""
    with run_in_background(listen=None, client_mode=True) as node:
        with pytest.raises(ValueError, match="accepts none"):
            Averager(
                node,
                "cfg/client",
                [np.zeros(4, np.float32)],
                config=AveragerConfig(client_mode=False),
            )
        Averager(node, "cfg/client", [np.zeros(4, np.float32)]).close()  # None: as the node


@pytest.mark.parametrize("name", ["bandwidth", "gather_window"])
def test_an_infinite_positive_number_is_refused_as_not_finite(name: str) -> None:
    with pytest.raises(ValueError, match=f"AveragerConfig.{name} must be a finite positive number"):
        AveragerConfig(**{name: float("inf")})
