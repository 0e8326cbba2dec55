"""Models other than causal LMs on the backend (#50). An encoder whose attention layers do not say `is_causal=False`
(Splinter's, ALIGN's and CLAP's text encoders have no `is_causal`) builds transformers' bidirectional mask, which the
backend got as the 2D padding mask: loaded with attn_implementation='sparse_cp' their hidden states differed from
eager's by 0.026 (Splinter), 0.032 (ALIGN), 0.49 (CLAP), attention computed causally, and configure() and the CP
checks accepted them. Now the mask is refused, naming the fix (under CP, dropping --cp_size too). A causal decoder of
an encoder family (BERT with is_decoder=True) still trains as sdpa does."""

import copy

import pytest
import torch
import transformers

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.call_tokens import NonCausalMask

pytestmark = pytest.mark.usefixtures("patched")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=128, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, pad_token_id=0)
# Encoders whose attention layers have no `is_causal` (they support eager attention only, not sdpa).
ENCODERS = {"splinter": ("SplinterConfig", "SplinterModel"), "align_text": ("AlignTextConfig", "AlignTextModel"),
            "clap_text": ("ClapTextConfig", "ClapTextModel")}
KEEP_ALL = SparseAttentionConfig(block_size=16, min_seq_len=0, sink_tokens=0, dense_first_layers=0,
                                 vertical_topk=10**4, slash_topk=10**4)  # (sdpa's attention, sparse path)


def _encoder(name: str) -> torch.nn.Module:
    config_class, model_class = (getattr(transformers, n) for n in ENCODERS[name])
    torch.manual_seed(0)
    return model_class(config_class(**SMALL)).double().eval()


@pytest.mark.parametrize("name", list(ENCODERS))
def test_an_encoder_without_is_causal_loaded_on_the_backend_is_refused_at_its_mask(name):
    model = _encoder(name)
    assert upstream.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sparse_cp")
    with pytest.raises(NonCausalMask, match=r"builds a bidirectional attention mask .*attn_implementation='sdpa' or "
                                            r"'eager' \(--sparse_attention false\)"):
        model(input_ids=torch.randint(3, 60, (2, 24)))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_configure_refuses_an_encoder_without_is_causal_and_leaves_it_as_it_was(name):
    model = _encoder(name)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} cannot train with sparse_cp\. .*builds a "
                                         r"bidirectional attention mask.*: train it with its own attention: "
                                         r"--sparse_attention false"):
        hf_sparse_cp.configure(model)
    assert upstream.attn_implementation(model.config) == "eager"


def test_under_cp_the_refusal_of_an_encoder_without_is_causal_drops_cp():
    """As the plugin's Trainer switches the model with --cp_size 2, before CP's own checks (which see the model on
    the backend and refuse it the same way)."""
    from hf_sparse_cp import SparseCPArguments, SparseTrainingArguments
    from hf_sparse_cp.integration.models import check_model_supports_context_parallel
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    fix = r"train it without context parallelism \(drop --cp_size\) and with its own attention"
    model = _encoder("splinter")
    args = SparseTrainingArguments("out", use_cpu=True, report_to=[], cp_size=2)
    with pytest.raises(ValueError, match=r"SplinterModel cannot train with sparse_cp\. .*bidirectional.*" + fix):
        enable_sparse_attention(model, SparseCPArguments(), training_args=args)
    assert upstream.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sparse_cp")  # (loaded on the backend: CP's check probes it)
    with pytest.raises(ValueError, match=r"SplinterModel cannot train with sparse_cp\. .*bidirectional.*" + fix):
        check_model_supports_context_parallel(model)



@pytest.mark.parametrize("registered", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("name", list(ENCODERS))
def test_the_cp_check_of_an_encoder_not_switched_refuses_it_as_bidirectional(name, registered):
    """Such an encoder loaded with eager attention and given to the CP check directly (not switched first) was told
    to train with --sparse_attention true, which then refuses it: its architecture does not run on the meta device
    (Splinter's padding check reads a value), so nothing probed it. The check probes the model itself switched for
    one forward (the backend registered for it when it is not) and refuses it for what it is, leaving it as it was."""
    from hf_sparse_cp.integration.backend import is_registered
    from hf_sparse_cp.integration.models import check_model_supports_context_parallel

    if not registered:
        hf_sparse_cp.unpatch()
    model = _encoder(name)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} cannot train with sparse_cp\. .*builds a "
                                         r"bidirectional attention mask.*: train it without context parallelism "
                                         r"\(drop --cp_size\) and with its own attention") as refused:
        check_model_supports_context_parallel(model)
    assert "--sparse_attention true" not in str(refused.value)
    assert upstream.attn_implementation(model.config) == "eager" and is_registered() == registered

def test_a_causal_decoder_of_an_encoder_family_trains_as_sdpa_does():
    """BERT with is_decoder=True (BertLMHeadModel, causal self-attention: its layers' `is_causal`) on the backend:
    logits and gradients equal sdpa's in float64."""
    torch.manual_seed(0)
    ref = transformers.BertLMHeadModel(transformers.BertConfig(**SMALL, is_decoder=True)).double().train()
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    hf_sparse_cp.configure(model, KEEP_ALL)
    ids = torch.randint(3, 60, (2, 64), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (ref, model):
        out = m(input_ids=ids, labels=ids)
        results.append((out.logits.detach(), torch.autograd.grad(out.loss, list(m.parameters()), allow_unused=True)))
    (logits_ref, grads_ref), (logits, grads) = results
    torch.testing.assert_close(logits, logits_ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, grads_ref):  # (the keys' bias gets no gradient but rounding: compared absolutely)
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["LayoutLM", "MarkupLM"])
def test_an_encoder_that_builds_its_own_4d_mask_loaded_on_the_backend_is_refused_naming_a_fix_that_runs(name):
    """LayoutLM's and MarkupLM's encoders build their own 4D mask: loaded on the backend they were refused with the
    fix 'call hf_sparse_cp.patch() before building the model', which changes nothing for them."""
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}Model")(getattr(transformers, f"{name}Config")(**SMALL)).eval()
    model.set_attn_implementation("sparse_cp")
    with pytest.raises(ValueError, match=r"4D attention mask \(model type '[a-z]+'\).*builds its own mask.*: load it "
                                         r"with attn_implementation='sdpa' or 'eager'"):
        model(input_ids=torch.randint(3, 60, (2, 24)))
