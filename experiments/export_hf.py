"""Writes a trained spsjax model as a Hugging Face directory that transformers loads.

  python experiments/export_hf.py --config=configs/export_hf.py:checkpoint=checkpoints/reference/target

The directory holds config.json (`LlamaForCausalLM` for our presets; the plainest type that has a
model's options otherwise, `hf.save_type`), model.safetensors (float32),
generation_config.json (the tokenizer's eos) and spsjax's SentencePiece model as
spsjax_tokenizer.model (`spsjax.data.tokenizer.Tokenizer`; not a transformers tokenizer: spsjax
spells a literal '▁' as bytes, which a plain SentencePiece tokenizer does not). The binaries take
the directory back as `hf_target=DIR` with that tokenizer. The directory may be a URI
(gs://bucket/...); process 0 writes it.
"""

from ml_collections import config_flags

from spsjax import cli, distributed, models, storage
from spsjax.models import hf
from spsjax.train import load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  model, tok, _ = load.load_model(c.checkpoint, step=c.step or None)
  path = hf.save(model, c.out, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
  storage.write_json(storage.join(path, 'generation_config.json'),
                     dict(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id), indent=1)
  tok.save(storage.join(path, load.SPSJAX_TOKENIZER))
  print0(f'Wrote {path}: {models.num_params(model.params):,} parameters as '
         f'{hf.SAVE_TYPES[hf.save_type(model.config)]}, '
         f'{load.SPSJAX_TOKENIZER} (SentencePiece, vocab {tok.vocab_size}).')


if __name__ == '__main__':
  cli.run(main)
