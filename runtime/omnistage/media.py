"""Input media shared by the HTTP API and the stages that consume IMAGE and AUDIO."""

#: Hz of the request tensors `input_audio.<i>` (float32 mono PCM) that reach an entry stage.
INPUT_AUDIO_SAMPLE_RATE = 16000
