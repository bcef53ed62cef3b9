"""A fault-injection ELECTRA generator for the e2e tests (hivemind-style: the real stage, misbehaving in
one way): at step 2 it sends one token id past the vocabulary, as a generator built with another
vocabulary would."""
from __future__ import annotations

from nebula.runtime.stage import Output
from services.electra.stages import ElectraGenerator

BAD_STEP = 2


class OutOfVocabularyGenerator(ElectraGenerator):
    def forward(self, batch, inputs) -> Output:
        out = super().forward(batch, inputs)
        if batch.training and batch.step == BAD_STEP and batch.micro_batch == 0:
            out.tensors["tokens"][0, 1] = len(self.vmap) + 5  # one id the discriminator's vocabulary lacks
        return out
