from pageserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
