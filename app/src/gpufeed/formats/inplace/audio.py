"""Encoded audio files decoded to waveforms, for the Hugging Face ``Audio`` feature read in
place: float32 ``[channels, samples]`` in [-1, 1) (torchaudio's layout) and the file's
sampling rate.

WAV (PCM 8, 16, 24 and 32-bit) is decoded by the standard library's ``wave``; anything else
(FLAC, OGG, MP3, float or extensible WAV) by ``soundfile`` when it is installed (``pip
install 'gpufeed[audio]'``), else a ValueError that says so. The header's sizes are untrusted: a
file declaring more than MAX_CHANNELS channels or more than MAX_AUDIO_BYTES of samples is
refused before anything is allocated. No resampling: the rate is the file's.
"""

from __future__ import annotations

import io
import wave

import numpy as np

__all__ = ["MAX_AUDIO_BYTES", "decode_audio"]

MAX_AUDIO_BYTES = 1 << 30  # decoded float32 bytes of one file (~93 min of 48 kHz stereo)
MAX_CHANNELS = 64
SOUNDFILE = "pip install 'gpufeed[audio]' (soundfile)"
# sample width in bytes -> (numpy dtype of one sample, its full scale)
_PCM = {1: ("u1", 128.0), 2: ("<i2", 32768.0), 3: (None, 8388608.0), 4: ("<i4", 2147483648.0)}


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """(float32 [channels, samples], sampling rate) of one encoded file; ValueError (what is
    wrong, or the package that would read it) otherwise."""
    data = bytes(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        try:
            return _wav(data)
        except wave.Error:
            pass  # float or extensible WAV: soundfile reads those
        except EOFError:
            raise ValueError("a WAV file cut short (its header does not read)") from None
    return _soundfile(data)


def _check_size(channels: int, frames: int) -> None:
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"its header declares {channels} channels (1 to {MAX_CHANNELS} read)")
    if frames < 0 or frames * channels * 4 > MAX_AUDIO_BYTES:
        raise ValueError(
            f"its header declares {frames:,} frames of {channels} channels, over the "
            f"{MAX_AUDIO_BYTES >> 20} MiB a decoded file may take (a damaged or crafted file)"
        )


def _wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
        _check_size(channels, w.getnframes())
        if width not in _PCM:
            raise ValueError(f"a WAV file of {width}-byte samples (1 to 4 read)")
        raw = w.readframes(w.getnframes())  # what is there: never more than the file holds
    frames = len(raw) // (width * channels)
    raw = raw[: frames * width * channels]
    dtype, scale = _PCM[width]
    if width == 3:  # 24-bit: three little-endian bytes, sign-extended into int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8
    else:
        ints = np.frombuffer(raw, dtype).astype(np.float32)
        if width == 1:
            ints -= 128.0
    wave_ = (np.asarray(ints, np.float32) / np.float32(scale)).reshape(frames, channels)
    return np.ascontiguousarray(wave_.T), int(rate)


def _soundfile(data: bytes) -> tuple[np.ndarray, int]:
    try:
        import soundfile as sf
    except ImportError:
        raise ValueError(
            f"not PCM WAV (it begins {data[:12]!r}); decoding FLAC, OGG, MP3 or float WAV "
            f"needs the soundfile package: {SOUNDFILE}"
        ) from None
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            _check_size(f.channels, f.frames)
            samples = f.read(dtype="float32", always_2d=True)
            rate = f.samplerate
    except RuntimeError as e:  # soundfile's LibsndfileError
        raise ValueError(f"not an audio file soundfile reads: {e}") from None
    return np.ascontiguousarray(samples.T), int(rate)
