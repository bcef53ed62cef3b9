"""What the ABNet model tests build on: four translation pairs, a vocabulary cut to some texts, and a
pre-trained model sliced to its first layers (fixtures `e5`, `minilm`: tests/unit/conftest.py)."""
from __future__ import annotations

import copy

from services.models.plm import Pretrained
from services.models.vocab import VocabMap, build_vocab_map, count_ids

PAIRS = [
    ("El gato duerme en el sofá.", "The cat is sleeping on the sofa."),
    ("Hoy hace mucho calor en Madrid.", "It is very hot in Madrid today."),
    ("Me gusta leer libros por la noche.", "I like to read books at night."),
    ("¿Dónde está la estación de tren?", "Where is the train station?"),
]


def vocab_map(pre: Pretrained, texts: list[str]) -> VocabMap:
    """The vocabulary of `pre` cut to the tokens of `texts`."""
    counts = count_ids(e.ids for e in pre.tokenizer.encode_batch(texts))
    return build_vocab_map(counts, pre.specials, pre.model.cfg.vocab_size)


def sliced(pre: Pretrained, layers: int) -> Pretrained:
    """A copy with the first ``layers`` real layers; the original stays intact for other tests."""
    return Pretrained(pre.name, copy.deepcopy(pre.model).truncate(layers), pre.tokenizer,
                      pre.specials)
