"""The autoregressive objective and beam search, on the real sliced PLMs and on the baseline."""
from __future__ import annotations

import copy

import pytest
import torch

from nebula.errors import ConfigError
from services.abnet.autoregressive import beam_search
from services.abnet.baseline import BaselineConfig, build_baseline
from services.abnet.model import AbnetConfig, Batch, build_source_encoder, build_target_decoder, train_step
from services.models.vocab import encode_texts
from tests.support.abnet import PAIRS, sliced, vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ar_small(e5, minilm):
    """Sliced ABNet (2 + 2 real layers) with the autoregressive decoder, and a batch of PAIRS."""
    torch.manual_seed(0)
    svm, tvm = vocab_map(e5, [s for s, _ in PAIRS]), vocab_map(minilm, [t for _, t in PAIRS])
    cfg = AbnetConfig(enc_adapter_dim=64, dec_adapter_ffn=128, dec_adapter_heads=4, objective="ar")
    enc = build_source_encoder(sliced(e5, 2), cfg, svm)
    dec = build_target_decoder(sliced(minilm, 2), cfg, enc.hidden_size, tvm)
    batch = Batch(*encode_texts(e5, svm, [s for s, _ in PAIRS], 32),
                  *encode_texts(minilm, tvm, [t for _, t in PAIRS], 32))
    return enc, dec, batch


def _targets(batch: Batch) -> list[list[int]]:
    """Content ids of each target: the [CLS] .. [SEP] frame and padding dropped."""
    return [row[m][1:-1].tolist() for row, m in zip(batch.tgt_ids, batch.tgt_mask)]


def _baseline(e5, minilm, objective: str):
    svm, tvm = vocab_map(e5, [s for s, _ in PAIRS]), vocab_map(minilm, [t for _, t in PAIRS])
    cfg = BaselineConfig(d_model=64, heads=4, ffn=128, enc_layers=1, dec_layers=1, objective=objective)
    return build_baseline(cfg, len(svm), svm.specials(e5.specials).pad, len(tvm), tvm.specials(minilm.specials))


def test_a_position_never_sees_later_tokens(ar_small, e5, minilm):
    enc, dec, batch = ar_small
    _, base_dec = _baseline(e5, minilm, "ar")
    hidden = enc.eval()(batch.src_ids, batch.src_mask)
    changed = batch.tgt_ids.clone()
    changed[:, 4:] = dec.specials.unk  # rewrite everything from position 4 on
    for decoder, h in ((copy.deepcopy(dec).eval(), hidden), (base_dec.eval(), torch.randn(*hidden.shape[:2], 64))):
        with torch.no_grad():
            a = decoder.features(h, batch.src_mask, batch.tgt_ids, batch.tgt_mask, causal=True)
            b = decoder.features(h, batch.src_mask, changed, batch.tgt_mask, causal=True)
            both_ways = decoder.features(h, batch.src_mask, changed, batch.tgt_mask)
        torch.testing.assert_close(a[:, :4], b[:, :4])
        assert not torch.allclose(a[:, 4:], b[:, 4:])
        assert not torch.allclose(a[:, :4], both_ways[:, :4])  # bidirectional does look ahead


def test_cached_decoding_matches_the_full_causal_pass(ar_small, e5, minilm):
    enc, dec, batch = ar_small
    _, base_dec = _baseline(e5, minilm, "ar")
    hidden = enc.eval()(batch.src_ids, batch.src_mask)
    ids = batch.tgt_ids[:, :6]  # prefixes without padding: what beam search feeds
    every = torch.ones_like(ids, dtype=torch.bool)
    for decoder, h in ((copy.deepcopy(dec).eval(), hidden), (base_dec.eval(), torch.randn(*hidden.shape[:2], 64))):
        with torch.no_grad():
            full = decoder.features(h, batch.src_mask, ids, every, causal=True)  # (B, 6, H)
            state = decoder.start_decoding(h, batch.src_mask)
            steps = [decoder.next_features(state, ids[:, t:t + 1]) for t in range(ids.shape[1])]
        torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_memorises_pairs_and_beam_search_reads_them_back(ar_small):
    enc, dec, batch = ar_small
    enc, dec = copy.deepcopy(enc), copy.deepcopy(dec)
    opt_e = torch.optim.Adam(enc.trainable_parameters(), 3e-3)
    opt_d = torch.optim.Adam(dec.trainable_parameters(), 3e-3)
    assert not hasattr(dec, "length")  # no length predictor: [SEP] ends a translation
    torch.manual_seed(0)
    losses = []
    for _ in range(40):
        enc.train(), dec.train()
        losses.append(float(train_step(enc, dec, batch, opt_e, opt_d).token_loss))
    assert losses[-1] < 0.3 * losses[0]
    enc.eval(), dec.eval()
    with torch.no_grad():
        hidden = enc(batch.src_ids, batch.src_mask)
    assert dec.decode(hidden, batch.src_mask, beam=4) == _targets(batch)
    capped = beam_search(dec, hidden, batch.src_mask, beam=4, max_len=3)  # ends forced at 3 words
    assert all(1 <= len(row) <= 3 for row in capped)


def _greedy(dec, hidden, src_mask, steps: int) -> list[list[int]]:
    """Argmax decoding written out plainly: the reference for beam 1."""
    out = []
    for i in range(hidden.shape[0]):
        prefix = [dec.specials.bos]
        for _ in range(steps):
            ids = torch.tensor([prefix])
            feats = dec.features(hidden[i:i + 1], src_mask[i:i + 1], ids, torch.ones_like(ids).bool(), causal=True)
            logp = dec.token_logits(feats[0, -1]).log_softmax(-1)
            banned = [t for t in dec.specials.as_list() if t != dec.specials.eos]
            logp[banned] = float("-inf")
            token = int(logp.argmax())
            if token == dec.specials.eos:
                break
            prefix.append(token)
        out.append(prefix[1:])
    return out


def test_beam_one_is_greedy_and_wider_beams_stay_valid(ar_small):
    enc, dec, batch = ar_small
    dec = copy.deepcopy(dec).eval()
    with torch.no_grad():  # an untrained but not degenerate decoder: perturbed adapters
        for p in dec.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
        hidden = enc.eval()(batch.src_ids, batch.src_mask)
        one = beam_search(dec, hidden, batch.src_mask, beam=1, max_len=6)
        assert one == _greedy(dec, hidden, batch.src_mask, steps=6)
        wide = beam_search(dec, hidden, batch.src_mask, beam=4)
    specials = set(dec.specials.as_list())
    limits = (batch.src_mask.sum(1) + dec.max_delta).tolist()
    for row, limit in zip(wide, limits):
        assert len(row) <= limit and not specials & set(row)


def test_baseline_learns_with_the_autoregressive_objective(e5, minilm):
    enc, dec = _baseline(e5, minilm, "ar")
    batch = Batch(*encode_texts(e5, vocab_map(e5, [s for s, _ in PAIRS]), [s for s, _ in PAIRS], 32),
                  *encode_texts(minilm, vocab_map(minilm, [t for _, t in PAIRS]), [t for _, t in PAIRS], 32))
    opt_e = torch.optim.Adam(enc.trainable_parameters(), 3e-3)
    opt_d = torch.optim.Adam(dec.trainable_parameters(), 3e-3)
    torch.manual_seed(0)
    first = float(train_step(enc, dec, batch, opt_e, opt_d).token_loss)
    for _ in range(60):
        enc.train(), dec.train()
        last = float(train_step(enc, dec, batch, opt_e, opt_d).token_loss)
    assert last < 0.3 * first
    enc.eval(), dec.eval()
    with torch.no_grad():
        assert dec.decode(enc(batch.src_ids, batch.src_mask), batch.src_mask) == _targets(batch)


def test_unknown_objective_is_a_config_error():
    with pytest.raises(ConfigError, match="objective = 'ctc'"):
        AbnetConfig(objective="ctc")
    with pytest.raises(ConfigError, match="\"ar\""):
        BaselineConfig(objective="left-to-right")


def test_length_cap_follows_the_source_and_no_ngram_repeats(ar_small):
    enc, dec, batch = ar_small
    dec = copy.deepcopy(dec).eval()
    with torch.no_grad():  # a decoder that loves one token: repeats are what it would say
        dec.head.bias[dec.specials.as_list()[-1] + 1] = 8.0
        hidden = enc.eval()(batch.src_ids, batch.src_mask)
        free = beam_search(dec, hidden, batch.src_mask, beam=2)
        capped = beam_search(dec, hidden, batch.src_mask, beam=2, max_len_a=0.5, max_len_b=1)
        no_repeat = beam_search(dec, hidden, batch.src_mask, beam=2, no_repeat_ngram=2)
    src_len = batch.src_mask.sum(1).tolist()
    assert any(len(row) > 0.5 * n + 1 for row, n in zip(free, src_len))  # the cap bites
    assert all(len(row) <= -(-n // 2) + 1 for row, n in zip(capped, src_len))  # ceil(0.5 n) + 1
    assert any(len(set(zip(row, row[1:]))) < len(row) - 1 for row in free)  # bigrams repeat without the ban
    for row in no_repeat:
        assert len(set(zip(row, row[1:]))) == len(row) - 1  # every bigram once
