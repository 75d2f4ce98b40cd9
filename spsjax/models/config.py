"""The transformer's hyper-parameters as one frozen, validated dataclass.

Invariant: a `TransformerConfig` that constructs is internally consistent (heads divide into kv
groups, dtype is supported, the kernels it names implement its options), so no model code needs
to re-check it.
"""

import dataclasses

import jax.numpy as jnp

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
# 'gelu' is GELU's tanh form (GPT-2's), 'gelu_exact' its erf form (GPT-NeoX's).
_MLP_KINDS = ('gated_silu', 'gated_gelu', 'gelu', 'gelu_exact')
# The MLPs with a gate and an input product (the gate through SiLU, or GELU's tanh form: Gemma).
GATED_MLPS = ('gated_silu', 'gated_gelu')
_NORMS = ('rms', 'layer')
_POSITIONS = ('rope', 'learned')
_ROPE_SCALINGS = ('linear', 'llama3', 'yarn', 'longrope')
KERNELS = ('xla', 'xla_fused', 'native')
SINGLE_ROW = ('auto', 'padded', 'plain', 'stream')
# How a placed model computes, not what it is: checkpoints do not store these fields.
COMPUTE_FIELDS = ('kernels', 'single_row')


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A rescaling of the rotary frequencies for contexts past the trained length, as Hugging Face
  configs name it (`rope_type`); `spsjax.models.rope` computes the frequencies.

  'linear': every frequency divided by `factor` (positions interpolated). 'llama3' (Llama 3.1 and
  3.2): the frequencies whose wavelength is under original_max_len / high_freq_factor kept, those
  over original_max_len / low_freq_factor divided by `factor`, the ones between interpolated
  smoothly. Neither changes the attention's temperature. 'yarn' (YaRN: Qwen's long contexts): the
  frequencies that turn more than beta_fast times over original_max_len kept, those turning
  fewer than beta_slow times divided by `factor`, a linear ramp over the dims between; queries
  and keys both scaled by `attention_factor` (None: 0.1 ln(factor) + 1, or 1 for factor <= 1).
  'longrope' (Phi-3.5, Phi-4 mini), up to original_max_len positions, where transformers uses its
  short factors: frequency i divided by short_factor[i]; queries and keys scaled by
  `attention_factor` (None: sqrt(1 + ln(factor) / ln(original_max_len)), or 1 for factor <= 1).
  Past that length transformers switches every position to the long factors: not computed here (a
  model with this scaling keeps max_seq_len <= original_max_len).
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0  # 'llama3' only, like high_freq_factor.
  high_freq_factor: float = 4.0
  original_max_len: int = 8192  # 'llama3', 'yarn' and 'longrope'.
  beta_fast: float = 32.0  # 'yarn' only, like beta_slow and truncate.
  beta_slow: float = 1.0
  attention_factor: float | None = None  # 'yarn' and 'longrope'.
  truncate: bool = True  # Whether the ramp's ends are rounded to whole dims (transformers').
  short_factor: tuple[float, ...] = ()  # 'longrope': one per rotated pair; a list becomes a tuple.
  long_factor: tuple[float, ...] = ()  # 'longrope' past original_max_len: kept, not computed.

  def __post_init__(self):
    if self.kind not in _ROPE_SCALINGS:
      raise ValueError(f'RopeScaling.kind must be one of {_ROPE_SCALINGS}, got {self.kind!r}.')
    for name in ('short_factor', 'long_factor'):
      object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
    if self.kind == 'longrope' and not (self.short_factor and min(self.short_factor) > 0):
      raise ValueError(f'longrope rope scaling wants short factors > 0, got {self.short_factor}.')
    if not self.factor > 0:
      raise ValueError(f'RopeScaling.factor must be > 0, got {self.factor}.')
    if self.kind == 'yarn' and not (self.beta_slow > 0 and self.beta_fast > 0
                                    and self.original_max_len >= 1
                                    and (self.attention_factor is None
                                         or self.attention_factor > 0)):
      raise ValueError(f'yarn rope scaling wants beta_fast, beta_slow, attention_factor > 0 and '
                       f'original_max_len >= 1, got {self}.')
    if self.kind == 'llama3' and not (0 < self.low_freq_factor < self.high_freq_factor
                                      and self.original_max_len >= 1):
      raise ValueError(
          f'llama3 rope scaling wants 0 < low_freq_factor < high_freq_factor and '
          f'original_max_len >= 1, got {self.low_freq_factor}, {self.high_freq_factor}, '
          f'{self.original_max_len}.')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Decoder-only transformer: RoPE, pre-norm RMSNorm, MHA/GQA/MQA, gated-SiLU, gated-GELU or
  GELU MLP; optionally q/k/v biases (Qwen2), query and key norms (Qwen3), embeddings scaled by
  sqrt(d_model) (Gemma), sliding windows on some or all layers (Mistral, Gemma 2 and 3), soft-capped
  scores and logits, post-norms and another score scale (Gemma 2), GPT-2's LayerNorm, learned
  positions and biases on every other projection, and GPT-NeoX's partial rotation and parallel
  block."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int | None = None  # None: as many as num_heads (MHA).
  d_ff: int = 0  # 0: 4 * d_model.
  max_seq_len: int = 2048
  dtype: str = 'float32'  # Parameters and activations; logits are always float32.
  head_dim: int | None = None  # None: d_model // num_heads.
  mlp: str = 'gated_silu'
  tie_embeddings: bool = True
  rope_base: float = 10_000.0
  rope_scaling: RopeScaling | None = None  # A dict (a checkpoint's JSON) becomes a RopeScaling.
  norm_eps: float = 1e-6
  qkv_bias: bool = False  # Biases on the q, k and v projections (Qwen2).
  # RMSNorms of each query and key head over its dims (a scale of head_dim each, shared by the
  # heads), after the projection and before the rotation (Qwen3).
  qk_norm: bool = False
  embed_scale: bool = False  # Token embeddings times sqrt(d_model), in `dtype` (Gemma).
  # A sliding attention window (Mistral, Phi-3, Gemma 2's and 3's local layers): a query sees its
  # own position and the window - 1 before it, on every layer but `global_layers`, whose queries
  # see every earlier position. None: every layer attends globally.
  sliding_window: int | None = None
  global_layers: tuple[int, ...] = ()  # A list (a checkpoint's JSON) becomes a tuple.
  # The rotary base of the sliding layers (Gemma 3's local base), unscaled; the global layers
  # keep rope_base and rope_scaling. None: rope_base and rope_scaling on every layer.
  local_rope_base: float | None = None
  query_scale: float | None = None  # Scores are q.k times this; None: head_dim ** -0.5.
  # Soft-capping (Gemma 2): attention scores x (after the scale), then the output logits, become
  # cap tanh(x / cap). None: no capping.
  attn_softcap: float | None = None
  logit_softcap: float | None = None
  # RMSNorms of the attention's and the MLP's outputs before each residual add, besides the
  # pre-norms (Gemma 2 and 3): scales `attn_post_norm` and `mlp_post_norm` of each layer.
  post_norms: bool = False
  dense_bias: bool = False  # Biases on the attention output and both MLP products (GPT-2).
  norm: str = 'rms'  # 'rms' or 'layer' (LayerNorm with a bias, GPT-2).
  # The head dims the rotation covers, the first ones of each head (GPT-NeoX's partial rotary:
  # a quarter of them), at frequencies base^(-i / (rope_dims / 2)); None: every dim.
  rope_dims: int | None = None
  # GPT-NeoX's parallel block: x + attention(attn_norm(x)) + mlp(mlp_norm(x)), the MLP reading
  # the block's input rather than the attention's output.
  parallel_residual: bool = False
  position: str = 'rope'  # 'rope' (rotary) or 'learned' (a table of max_seq_len rows, GPT-2).
  # A feature head's (`feature_head`) taps of its target's residual stream, increasing: i < the
  # target's num_layers is layer i's input, num_layers the last layer's output before the final
  # norm. () reads that last output alone (EAGLE-1); several are read side by side and projected
  # to one stream (EAGLE-3). A list (a checkpoint's JSON) becomes a tuple.
  feature_taps: tuple[int, ...] = ()
  # A feature head's own output layer over a draft vocabulary of this many of the target's
  # tokens (EAGLE-3's d2t: the most frequent in its training data; `feature_head`'s
  # `draft_vocab`): a final norm and a [D, draft_vocab_size] product, the other tokens never
  # drafted. 0 reads the target's output layer (every token).
  draft_vocab_size: int = 0
  # A feature head's drafts per pass (Falcon's semi-autoregressive k, `feature_head`): its
  # queries see the pairs up to their block's end, m - 1 - j ahead of the j-th of a block of m,
  # and predict the features m positions on. 1: one draft a pass (EAGLE).
  drafts_per_pass: int = 1
  # What computes the projections and the cached attention: 'xla' (XLA's ops on the parameters
  # `init_params` makes), 'xla_fused' (XLA's ops on weights fused for decoding by `models.fuse`:
  # q, k and v one product, a gated MLP's gate and input one; `models.unfuse` sets 'xla' back) or
  # 'native' (the CPU kernels of `spsjax.native` on weights packed by `models.pack`, which sets
  # it; `models.unpack` sets 'xla' back). How a placed model computes, not what it is:
  # checkpoints do not store it.
  kernels: str = 'xla'
  # XLA's products of a single row (batch 1, one position: decoding's steps). XLA:GPU rewrites a
  # matrix-vector product whose weight has under 10M elements as a multiply and a reduce, which
  # read the weight at a fraction of a GEMM's rate; 'padded' gives such a product a second, zero
  # row (one GEMM of two rows, the weight read once), 'plain' leaves it, 'auto' pads where JAX's
  # default backend is a GPU; 'stream' carries the residual stream at two rows instead (padded
  # once at the embedding, the second row zero; attention on the real row only), so a norm feeds
  # its product with no pad between them. Not stored by checkpoints either.
  single_row: str = 'auto'

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, 'rope_scaling', RopeScaling(**self.rope_scaling))
    if self.rope_scaling is not None and (not isinstance(self.rope_scaling, RopeScaling)
                                          or self.position != 'rope'):
      raise ValueError(f'rope_scaling must be a RopeScaling (or its dict) of a rotary model, got '
                       f'{self.rope_scaling!r} with position {self.position!r}.')
    scaling = self.rope_scaling
    if scaling is not None and scaling.kind == 'longrope' and (
        self.max_seq_len > scaling.original_max_len
        or 2 * len(scaling.short_factor) != self.rotary_dims):
      raise ValueError(f'longrope scaling is computed up to original_max_len='
                       f'{scaling.original_max_len} positions with a short factor per rotated '
                       f'pair ({self.rotary_dims // 2}); got max_seq_len={self.max_seq_len}, '
                       f'{len(scaling.short_factor)} factors.')
    object.__setattr__(self, 'global_layers', tuple(self.global_layers))
    object.__setattr__(self, 'feature_taps', tuple(self.feature_taps))
    if list(self.feature_taps) != sorted(set(self.feature_taps)) or any(
        t < 0 for t in self.feature_taps):
      raise ValueError(f'feature_taps must be increasing layer indices >= 0, got '
                       f'{self.feature_taps}.')
    if not 0 <= self.draft_vocab_size <= self.vocab_size:
      raise ValueError(f'draft_vocab_size must be in [0, vocab_size={self.vocab_size}] (0: the '
                       f'target\'s output layer), got {self.draft_vocab_size}.')
    if self.drafts_per_pass < 1:
      raise ValueError(f'drafts_per_pass must be >= 1, got {self.drafts_per_pass}.')
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f'sliding_window must be >= 1 (or None), got {self.sliding_window}.')
    if self.global_layers and (self.sliding_window is None or list(self.global_layers) != sorted(
        set(self.global_layers)) or not 0 <= self.global_layers[0] <= self.global_layers[-1]
                               < self.num_layers):
      raise ValueError(f'global_layers must be increasing layer indices in [0, num_layers='
                       f'{self.num_layers}) of a model with a sliding_window, got '
                       f'{self.global_layers} with window {self.sliding_window}.')
    if self.local_rope_base is not None and (self.sliding_window is None
                                             or self.position != 'rope'):
      raise ValueError('local_rope_base is the rotary base of sliding layers: it needs a '
                       'sliding_window and rotary positions.')
    for name in ('query_scale', 'attn_softcap', 'logit_softcap', 'local_rope_base'):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise ValueError(f'{name} must be > 0 (or None), got {getattr(self, name)}.')
    for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'max_seq_len'):
      if getattr(self, name) < 1:
        raise ValueError(f'TransformerConfig.{name} must be >= 1, got {getattr(self, name)}.')
    if self.num_kv_heads is not None and not 1 <= self.num_kv_heads <= self.num_heads:
      raise ValueError(
          f'num_kv_heads must be in [1, num_heads={self.num_heads}], got {self.num_kv_heads}.')
    if self.num_heads % self.kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}.')
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f'd_model={self.d_model} is not divisible by num_heads={self.num_heads}; set head_dim.')
    if self.rotary_dims % 2 and self.position == 'rope':
      raise ValueError(f'The rotated dims (head_dim, or rope_dims) must be even, got '
                       f'{self.rotary_dims}.')
    if self.rope_dims is not None and (self.position != 'rope'
                                       or not 2 <= self.rope_dims <= self.dims_per_head):
      raise ValueError(f'rope_dims must be in [2, head_dim={self.dims_per_head}] on a rotary '
                       f'model, got {self.rope_dims}.')
    if self.dtype not in _DTYPES:
      raise ValueError(f'dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}.')
    if self.mlp not in _MLP_KINDS:
      raise ValueError(f'mlp must be one of {_MLP_KINDS}, got {self.mlp!r}.')
    if self.norm not in _NORMS:
      raise ValueError(f'norm must be one of {_NORMS}, got {self.norm!r}.')
    if self.position not in _POSITIONS:
      raise ValueError(f'position must be one of {_POSITIONS}, got {self.position!r}.')
    if self.d_ff < 0:
      raise ValueError(f'd_ff must be >= 0, got {self.d_ff}.')
    if self.kernels not in KERNELS:
      raise ValueError(f'kernels must be one of {KERNELS}, got {self.kernels!r}.')
    if self.single_row not in SINGLE_ROW:
      raise ValueError(f'single_row must be one of {SINGLE_ROW}, got {self.single_row!r}.')
    if self.qk_norm and self.norm != 'rms':
      raise ValueError('qk_norm is an RMSNorm of queries and keys: it needs norm=\'rms\'.')
    if self.kernels == 'native' and self.dtype != 'float32':
      raise ValueError(f'The native kernels compute float32 models; this one is {self.dtype}.')

  def window(self, layer: int) -> int | None:
    """Layer `layer`'s sliding window, None where it attends globally."""
    return None if layer in self.global_layers else self.sliding_window

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def dims_per_head(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  @property
  def rotary_dims(self) -> int:
    """The head dims the rotation covers (`rope_dims`, or all)."""
    return self.dims_per_head if self.rope_dims is None else self.rope_dims

  @property
  def ff_dim(self) -> int:
    return self.d_ff or 4 * self.d_model

  @property
  def gpt2_style(self) -> bool:
    """Whether any option of GPT-2's or GPT-NeoX's is on (LayerNorm, learned positions, dense
    biases, partial rotation, a parallel block): models Hugging Face's loader reads but `save`
    does not write."""
    return (self.norm != 'rms' or self.position != 'rope' or self.dense_bias
            or self.rope_dims is not None or self.parallel_residual)

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]
