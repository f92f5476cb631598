"""Data modules that need no download and depend only on their arguments (``seed`` included).

Vectors for the MLPs (:class:`SyntheticClassificationData`, :class:`DigitsData`) and token
sequences for the GPTs (:class:`SyntheticTokensData`, :class:`CharCorpusData`).
"""

from lightning_parallel.data.base import SplitDataModule, Splits
from lightning_parallel.data.char_corpus import CharCorpusData, decode, encode
from lightning_parallel.data.digits import DigitsData
from lightning_parallel.data.synthetic import SyntheticClassificationData, SyntheticTokensData

__all__ = [
    "CharCorpusData",
    "DigitsData",
    "SplitDataModule",
    "Splits",
    "SyntheticClassificationData",
    "SyntheticTokensData",
    "decode",
    "encode",
]
