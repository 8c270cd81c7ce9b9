"""Device selection: CUDA_VISIBLE_DEVICES is honoured and the CPU is the fallback."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from omnistage.devices import select_device  # noqa: E402


def test_empty_cuda_visible_devices_means_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: deleting the empty-CUDA_VISIBLE_DEVICES rule. torch is made to claim a GPU, so
    only that rule can answer "cpu" here (without it, "auto" would pick cuda)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("OMNISTAGE_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device().type == "cpu"
    assert select_device("auto").type == "cpu"


def test_auto_falls_back_to_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto").type == "cpu"


def test_auto_picks_cuda_when_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device().type == "cuda"


def test_explicit_cuda_without_a_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*CUDA_VISIBLE_DEVICES=''"):
        select_device("cuda")


def test_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: deleting the OMNISTAGE_DEVICE override. "meta" is a device "auto" never picks,
    and with a (pretend) GPU visible "auto" would say cuda: only the override gives meta."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("OMNISTAGE_DEVICE", "meta")
    assert select_device().type == "meta"


def test_explicit_request_beats_the_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: the env variable taking precedence over the worker's configured device."""
    monkeypatch.setenv("OMNISTAGE_DEVICE", "meta")
    assert select_device("cpu").type == "cpu"


def test_env_override_to_an_absent_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: the override skipping the availability check (a silent CPU or a torch crash)."""
    monkeypatch.setenv("OMNISTAGE_DEVICE", "cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"device 'cuda:1' requested but CUDA is not"):
        select_device()


@pytest.mark.parametrize(("value", "want"), [(None, 1), ("3", 3)])
def test_configure_threads_caps_torch_threads(monkeypatch: pytest.MonkeyPatch,
                                              value: str | None, want: int) -> None:
    """Kills: a default other than one thread per worker, and ignoring OMNISTAGE_TORCH_THREADS."""
    from omnistage.devices import configure_threads

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    if value is None:
        monkeypatch.delenv("OMNISTAGE_TORCH_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMNISTAGE_TORCH_THREADS", value)
    configure_threads()
    assert calls == [want]


def test_configure_threads_zero_leaves_torch_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: `n > 0` turned into `n >= 0` (torch rejects 0 threads)."""
    from omnistage.devices import configure_threads

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv("OMNISTAGE_TORCH_THREADS", "0")
    configure_threads()
    assert calls == []
