"""tollway: an LLM inference server with fast, standard and batch lanes on one engine."""
from importlib.metadata import PackageNotFoundError, version

from tollway.request import SamplingParams

try:
    __version__ = version("tollway")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch; keep `import tollway` light for the scheduler and the simulator.
    if name == "LLM":
        from tollway.llm import LLM

        return LLM
    raise AttributeError(name)
