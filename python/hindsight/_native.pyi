"""Type stubs for the Rust extension. Use the wrappers in `hindsight` instead."""

from collections.abc import Callable
from typing import Any

FORMAT_VERSION: int
DEFAULT_STAGING_BYTES: int

class SaveHandle:
    """Tracks one background save until it is durable."""

    @property
    def name(self) -> str: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> dict[str, float] | None:
        """Block until durable (GIL released); raise the save's error; None on timeout."""

class Buffer:
    def __len__(self) -> int: ...

class Store:
    def __init__(
        self,
        path: str,
        create: bool = True,
        compression: str | None = None,
        zstd_level: int | None = None,
        chunk_size: int | None = None,
        staging_bytes: int | None = None,
        threads: int | None = None,
    ) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def compression(self) -> str: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def staging_bytes(self) -> int: ...
    def staging_in_use(self) -> int: ...
    def save(
        self,
        name: str,
        state: Any,
        describe: Callable[[Any, str], tuple[Any, ...]],
        materialize: Callable[[Any], tuple[int, Any]],
        before_copy: Callable[[], None],
        meta: dict[str, str] | None = None,
        skip_unchanged: bool = True,
        copy_threads: int = 2,
    ) -> SaveHandle: ...
    def load(
        self,
        name: str,
        make_array: Callable[..., Any],
        unpickle: Callable[[bytes, str], Any],
        path: list[str] | None = None,
        threads: int = 4,
    ) -> Any: ...
    def list(self) -> list[str]: ...
    def info(self, name: str) -> dict[str, Any]: ...
    def flush(self, timeout: float | None = None) -> bool: ...
    def remove(self, name: str) -> None: ...
    def verify(self, names: list[str] | None = None) -> tuple[int, list[str]]: ...
    def gc(self) -> dict[str, int]: ...
    def usage(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def forget_unchanged(self) -> None: ...

def run_cli(args: list[str]) -> tuple[int, str, str]: ...
