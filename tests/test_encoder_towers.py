"""`vlserve encode --towers`: an encoder that holds the audio tower only, the vision tower only, or both (the
default: every tower the model has). It loads only those towers' weights, announces only their kinds in its Pong,
refuses media of other kinds, and the rows it makes are the whole model's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.audio_samples import data_url as audio_data_url
from tests.audio_samples import encode_audio, noise
from tests.conftest import noise_image
from tests.test_disagg import data_url
from tests.test_encode_service import _run
from vlserve.cli import build_parser
from vlserve.core.config import ENCODE, DisaggArgs, EngineArgs, Options
from vlserve.core.errors import ConfigurationError, InvalidInputError, ServiceUnavailableError
from vlserve.core.options import options_from
from vlserve.core.prompt import media_kinds_needed
from vlserve.disagg.bootstrap import InstanceInfo
from vlserve.disagg.encode_service import EncodeService
from vlserve.disagg.messages import TransferRequest
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.peer_client import PeerClient, PeerConn
from vlserve.disagg.peer_kinds import ENCODER_PEERS
from vlserve.engine.transfer_buffers import TransferBuffers

MODULES = {"vision": "visual", "audio": "audio_tower"}
OMNI_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
OMNI_IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"


def _service(path, towers=None) -> EncodeService:
    return EncodeService(Options(engine=EngineArgs(model=str(path), dtype="float32", towers=towers),
                                 disagg=DisaggArgs(disagg_secret="test-encode-secret")))


@pytest.fixture(scope="module")
def omni_services(tiny_ckpt):
    """name -> an encode service of tiny Qwen2.5-Omni: "both" (the default), "audio", "vision"."""
    path = tiny_ckpt("qwen2_5_omni")
    made = {}
    try:
        for name, towers in (("both", None), ("audio", ("audio",)), ("vision", ("vision",))):
            made[name] = _service(path, towers)
        yield made
    finally:
        for svc in made.values():
            asyncio.run(svc.aclose())


def _wav(seconds: float, seed: int) -> str:
    return audio_data_url(encode_audio(noise(int(16000 * seconds), seed), 16000))


def _check(service, req) -> None:
    service.check_kinds(req.media, req.mm_processor_kwargs)


def _request(media: dict, prompt: str, mm_kwargs: dict | None = None) -> TransferRequest:
    return TransferRequest("r", 0, prompt, media, {k: [None] * len(v) for k, v in media.items()}, mm_kwargs or {},
                           [0], 16)


async def _rows(service: EncodeService, prompt: str, media: dict) -> list[torch.Tensor]:
    processed = (await service.prompts.encode({"prompt": prompt, "multi_modal_data": media}, {}, "r")).prompt
    rows = [r.clone() for r in await service._embeddings(processed, "t")]
    service.encoders.free(service.cache.release_all("t", processed.mm_items))
    return rows


def test_each_encoder_loads_and_announces_only_its_towers(omni_services):
    both, audio, vision = omni_services["both"], omni_services["audio"], omni_services["vision"]
    for svc, towers, kinds in ((both, ("vision", "audio"), ["image", "video", "audio"]),
                               (audio, ("audio",), ["audio"]), (vision, ("vision",), ["image", "video"])):
        model = svc.encoders.model.model
        names = {name.split(".", 1)[0] for name, _ in model.named_parameters()}
        assert names == {MODULES[t] for t in towers}, names  # the other tower's weights never loaded
        assert svc.cfg.towers == towers
        assert svc.pong(7).modalities == kinds
    # the same architecture and widths: a language server pairs with each
    assert {(p.architecture, p.hidden_size, p.side_rows) for p in
            (both.pong(1), audio.pong(1), vision.pong(1))} == {(both.pong(1).architecture,
                                                                 both.pong(1).hidden_size, 0)}


def test_rows_of_a_one_tower_encoder_are_the_whole_models(omni_services):
    both, audio, vision = omni_services["both"], omni_services["audio"], omni_services["vision"]
    sound = {"audio": [_wav(1.2, 3)]}
    picture = {"image": [data_url(noise_image(56, 56, 4))]}

    async def scenario():
        return [await _rows(both, OMNI_AUDIO + "Hi", sound), await _rows(audio, OMNI_AUDIO + "Hi", sound),
                await _rows(both, OMNI_IMAGE + "Hi", picture), await _rows(vision, OMNI_IMAGE + "Hi", picture)]

    want_sound, got_sound, want_sight, got_sight = _run(scenario(), [])
    assert got_sound[0].shape[0] > 2
    torch.testing.assert_close(got_sound, want_sound, rtol=0, atol=0)
    torch.testing.assert_close(got_sight, want_sight, rtol=0, atol=0)


def test_media_of_another_kind_is_refused_clearly(omni_services):
    audio, vision, both = omni_services["audio"], omni_services["vision"], omni_services["both"]
    picture = {"image": [data_url(noise_image(56, 56, 4))]}
    with pytest.raises(ServiceUnavailableError, match=r"no tower for image items \(its --towers: audio, encoding "
                                                      r"audio\)"):
        _check(audio, _request(picture, OMNI_IMAGE))
    with pytest.raises(ServiceUnavailableError, match="no tower for audio items"):
        _check(vision, _request({"audio": [_wav(1, 1)], **picture}, OMNI_AUDIO + OMNI_IMAGE))
    # a video heard with its sound needs the audio tower too; seen only, the vision tower is enough
    video = {"video": ["data:video/mp4;base64,AAAA"]}
    with pytest.raises(ServiceUnavailableError, match="no tower for audio items"):
        _check(vision, _request(video, "<|VIDEO|>", {"use_audio_in_video": True}))
    _check(vision, _request(video, "<|VIDEO|>"))
    _check(both, _request(video, "<|VIDEO|>", {"use_audio_in_video": True}))
    _check(audio, _request({"audio": [_wav(1, 1)]}, OMNI_AUDIO))


def test_media_kinds_needed():
    omni = ("image", "video", "audio")
    assert media_kinds_needed({"image": ["a"], "video": [], "audio": ["b"]}, None, omni) == {"image", "audio"}
    assert media_kinds_needed({"video": ["v"]}, {"use_audio_in_video": True}, omni) == {"video", "audio"}
    assert media_kinds_needed({"video": ["v"]}, {"use_audio_in_video": False}, omni) == {"video"}
    # a model that cannot hear refuses the flag in its input processor (400), not through routing
    assert media_kinds_needed({"video": ["v"]}, {"use_audio_in_video": True}, ("image", "video")) == {"video"}


def test_a_tower_the_model_lacks_is_refused_at_start(tiny_ckpt):
    path = tiny_ckpt("qwen2_audio")
    with pytest.raises(ConfigurationError, match=r"this model has no vision tower \(it has: audio\)"):
        _service(path, ("vision",))
    svc = _service(path)  # the default: every tower the model has
    try:
        assert svc.cfg.towers == ("audio",) and svc.pong(1).modalities == ["audio"]
    finally:
        asyncio.run(svc.aclose())


def test_towers_flag():
    def parse(*args: str) -> Options:
        return options_from(build_parser().parse_args(["encode", "--model", "m", *args]), ENCODE)

    assert parse().engine.towers is None
    assert parse("--towers", "audio").engine.towers == ("audio",)
    assert parse("--towers", "vision", "audio").engine.towers == ("vision", "audio")
    with pytest.raises(SystemExit):
        parse("--towers", "image")
    with pytest.raises(SystemExit):  # an encoder's option only
        build_parser().parse_args(["serve", "--model", "m", "--towers", "audio"])
    for bad in ((), ("ears",), "audio"):
        with pytest.raises(InvalidInputError, match="towers takes one or more of vision, audio"):
            EngineArgs(model="m", towers=bad).check()


def test_a_receiver_sends_a_prompt_only_to_an_encoder_that_encodes_all_its_kinds():
    """Fake paired encoders (nothing is sent): the pick among those whose Pong named every kind a prompt needs;
    when none did, the wait for one ends in a 503 that names the kinds."""
    buffers = TransferBuffers.create(4, 16, 8, torch.float32, shared=False)
    omni = SimpleNamespace(max_model_len=1024, model=SimpleNamespace(modalities=("image", "video", "audio")))
    client = PeerClient(omni, buffers, TransferMetrics(CollectorRegistry(), buffers, "language"),
                        DisaggArgs(bootstrap="127.0.0.1:9", peer_wait_timeout=0.2),
                        InstanceInfo("me", "language", "127.0.0.1:2"), ENCODER_PEERS)
    kinds = {"ears": {"audio"}, "eyes": {"image", "video"}, "both": {"image", "video", "audio"}}
    try:
        for i, (name, modalities) in enumerate(kinds.items()):
            client.conns[name] = PeerConn(InstanceInfo(name, "encode", f"127.0.0.1:{10 + i}"), sock=None,
                                          paired=True, modalities=frozenset(modalities))

        def picks(needs: set[str]) -> set[str]:
            return {client._pick(f"key-{i}", set(), frozenset(needs)).info.instance_id for i in range(40)}

        assert picks({"audio"}) == {"ears", "both"}
        assert picks({"image"}) == picks({"video"}) == {"eyes", "both"}
        assert picks({"audio", "image"}) == picks({"video", "audio"}) == {"both"}
        del client.conns["both"]
        assert client._pick("k", set(), frozenset({"audio", "image"})) is None
        media = {"audio": ["data:audio/wav;base64,AAAA"], "image": ["data:image/png;base64,AAAA"]}

        async def refused():
            with pytest.raises(ServiceUnavailableError, match="no encoder that encodes audio and image is available"):
                await client.send_prompt("r", "p", media, {}, {})
            with pytest.raises(ServiceUnavailableError, match="no encoder that encodes audio and video"):
                await client.send_prompt("r", "p", {"video": ["v"]}, {}, {"use_audio_in_video": True})

        asyncio.run(refused())
    finally:
        client.transport.close()
