"""tollway: an LLM inference server with fast, standard and batch lanes on one engine."""
from tollway.request import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch; keep `import tollway` light for the scheduler and the simulator.
    if name == "LLM":
        from tollway.llm import LLM

        return LLM
    raise AttributeError(name)
