//! The explicit KV cache: a value that a prefill builds and experiments clone,
//! read, edit and extend.
//!
//! Per layer it holds post-RoPE keys and values, `[batch, n_kv_heads, len,
//! head_dim]`. Entries are laid out as segments: the receiver's own tokens and,
//! for augmentation, extra attendable segments appended from another pass,
//! which keep the RoPE of their own positions. New tokens take the next *own*
//! position: appended segments add attendable entries but no positions.

use crate::config::ModelConfig;
use crate::error::{Result, RuntimeError};
use candle_core::{Device, Tensor};

/// Where a run of cache entries came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// Tokens this cache's own forward calls processed.
    Own,
    /// Entries appended from another pass (augmentation).
    Appended,
}

/// A contiguous run of cache entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Where the run came from.
    pub kind: SegmentKind,
    /// Index of its first entry.
    pub start: usize,
    /// Number of entries.
    pub len: usize,
}

/// Keys and values of one layer, `[batch, n_kv_heads, len, head_dim]` each.
#[derive(Debug, Clone)]
pub struct LayerKv {
    /// Post-RoPE keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
}

/// The per-sequence layout of a padded batch ([`KvCache::stack_padded`]):
/// sequences of different lengths share one tensor per layer, each with its
/// own entries, its own padding (entries no query attends to) and its own
/// next RoPE position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowLayout {
    /// Per sequence and entry: whether the entry belongs to the sequence
    /// (false: padding, masked out of every attention).
    valid: Vec<Vec<bool>>,
    /// Per sequence, the RoPE position its next new token takes.
    next: Vec<usize>,
}

impl RowLayout {
    /// Per sequence and entry, whether the entry is the sequence's own
    /// (true) or padding (false).
    pub fn valid(&self) -> &[Vec<bool>] {
        &self.valid
    }

    /// Per sequence, the RoPE position its next new token takes.
    pub fn next_positions(&self) -> &[usize] {
        &self.next
    }

    /// The sequences' real entry counts.
    pub fn lens(&self) -> Vec<usize> {
        self.valid
            .iter()
            .map(|r| r.iter().filter(|&&v| v).count())
            .collect()
    }
}

/// Entries of spare capacity a cache reserves when it first grows by
/// appending to existing entries (a question after a prefill), so the
/// decoding steps that follow write in place instead of copying the cache.
const SLACK: usize = 64;

/// The cache of every layer, with its segment layout and next position.
///
/// A cache that grows past its first forward call keeps its keys and values
/// in buffers with spare capacity and writes new entries into them in place.
/// Only a cache that owns its buffers alone does so: a clone, a narrow or a
/// stack starts without spare capacity and copies on its first growth, so
/// no operation on one cache changes another.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// Per layer, buffers `[batch, n_kv_heads, capacity, head_dim]` whose
    /// first `len()` entries are the layer's keys and values, owned by this
    /// cache alone.
    spare: Vec<Option<(Tensor, Tensor)>>,
    batch: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// The next new token's RoPE position (of a padded batch, each
    /// sequence's is in `rows` instead).
    next_position: usize,
    segments: Vec<Segment>,
    /// A padded batch's per-sequence layout; `None` when every sequence
    /// attends to every entry and takes the same next position.
    rows: Option<RowLayout>,
    device: Device,
}

impl Clone for KvCache {
    /// A cache with the same entries; it shares their storage but none of
    /// the spare capacity (the first growth of either copies).
    fn clone(&self) -> Self {
        Self {
            layers: self.layers.clone(),
            spare: vec![None; self.layers.len()],
            batch: self.batch,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            next_position: self.next_position,
            segments: self.segments.clone(),
            rows: self.rows.clone(),
            device: self.device.clone(),
        }
    }
}

impl KvCache {
    /// An empty cache for `batch` sequences of a model.
    pub fn new(cfg: &ModelConfig, batch: usize, device: &Device) -> Self {
        Self {
            spare: vec![None; cfg.n_layers],
            layers: vec![None; cfg.n_layers],
            batch,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            next_position: 0,
            segments: Vec::new(),
            rows: None,
            device: device.clone(),
        }
    }

    /// A cache of one layout from its parts, as [`KvCache::layer`],
    /// [`KvCache::segments`] and [`KvCache::next_position`] read them from
    /// a cache of sequences that share one layout (a cache kept on disk and
    /// read back): every layer's keys and values, the segments covering
    /// their entries in order, the next own token's RoPE position. Refused,
    /// naming what disagrees: a layer count or entry shape other than the
    /// model's, segments that do not tile the entries, an empty cache.
    pub fn from_parts(
        cfg: &ModelConfig,
        layers: Vec<LayerKv>,
        segments: Vec<Segment>,
        next_position: usize,
    ) -> Result<Self> {
        let bad = |reason: String| RuntimeError::BadIntervention {
            site: "kv cache from parts".into(),
            reason,
        };
        if layers.len() != cfg.n_layers {
            return Err(bad(format!(
                "{} layers of keys and values, the model has {}",
                layers.len(),
                cfg.n_layers
            )));
        }
        let mut at = 0;
        for s in &segments {
            if s.start != at || s.len == 0 {
                return Err(bad(format!(
                    "segments {segments:?} do not tile the entries from 0 without gaps"
                )));
            }
            at += s.len;
        }
        if at == 0 {
            return Err(bad("no entries".into()));
        }
        let first = &layers[0].k;
        let (batch, device) = (first.dim(0)?, first.device().clone());
        let mut cache = Self::new(cfg, batch, &device);
        cache.segments = segments;
        cache.next_position = next_position;
        for (l, kv) in layers.into_iter().enumerate() {
            cache.check_shape(&format!("blocks.{l}.attn.hook_rot_k"), &kv.k, at)?;
            cache.check_shape(&format!("blocks.{l}.attn.hook_v"), &kv.v, at)?;
            cache.layers[l] = Some(kv);
        }
        Ok(cache)
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Number of attendable entries (own and appended).
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Whether the cache holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The RoPE position the next new token takes (in a padded batch, the
    /// furthest of any sequence's).
    pub fn next_position(&self) -> usize {
        match &self.rows {
            Some(rows) => rows.next.iter().copied().max().unwrap_or(0),
            None => self.next_position,
        }
    }

    /// The segment layout (in a padded batch, of the entries' slots only:
    /// each sequence's own layout is in [`KvCache::rows`]).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// A padded batch's per-sequence layout; `None` for a cache whose
    /// sequences share one layout.
    pub fn rows(&self) -> Option<&RowLayout> {
        self.rows.as_ref()
    }

    fn refuse_padded(&self, op: &str) -> Result<()> {
        if self.rows.is_some() {
            return Err(RuntimeError::BadIntervention {
                site: format!("kv cache {op}"),
                reason: "a padded batch of sequences is for reading questions and decoding only; \
                         edit, narrow or stack the sequences' own caches before padding them"
                    .into(),
            });
        }
        Ok(())
    }

    /// The device the tensors live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Keys and values of layer `l`; `None` while the cache is empty.
    pub fn layer(&self, l: usize) -> Option<&LayerKv> {
        self.layers.get(l).and_then(|x| x.as_ref())
    }

    /// Keys and values of layer `l`, or an error naming the layer.
    pub fn require_layer(&self, l: usize) -> Result<&LayerKv> {
        self.check_layer(l)?;
        self.layer(l).ok_or_else(|| RuntimeError::BadIntervention {
            site: format!("blocks.{l}.attn.hook_rot_k"),
            reason: "the cache is empty at this layer".into(),
        })
    }

    fn check_layer(&self, l: usize) -> Result<()> {
        if l >= self.layers.len() {
            return Err(RuntimeError::LayerOutOfRange {
                site: format!("kv cache layer {l}"),
                layer: l,
                n_layers: self.layers.len(),
            });
        }
        Ok(())
    }

    fn check_shape(&self, site: &str, t: &Tensor, len: usize) -> Result<()> {
        let want = [self.batch, self.n_kv_heads, len, self.head_dim];
        if t.dims() != want {
            return Err(RuntimeError::BadIntervention {
                site: site.to_string(),
                reason: format!(
                    "expected keys/values of shape {want:?} (batch, n_kv_heads, len, head_dim), got {:?}",
                    t.dims()
                ),
            });
        }
        Ok(())
    }

    /// Replaces layer `l`'s keys and values with tensors of the same shape.
    pub fn set_layer(&mut self, l: usize, k: Tensor, v: Tensor) -> Result<()> {
        self.refuse_padded("set layer")?;
        self.check_layer(l)?;
        let len = self.len();
        self.check_shape(&format!("blocks.{l}.attn.hook_rot_k"), &k, len)?;
        self.check_shape(&format!("blocks.{l}.attn.hook_v"), &v, len)?;
        self.layers[l] = Some(LayerKv { k, v });
        self.spare[l] = None;
        Ok(())
    }

    /// Appends newly computed own-token keys and values at layer `l` (forward use).
    ///
    /// The first call keeps the tensors as they are; a later one writes into
    /// this cache's spare capacity when it has enough, else copies the
    /// entries into new buffers with [`SLACK`] spare entries (a call of more
    /// than [`SLACK`] tokens that does not fit the spare capacity joins them
    /// exactly, without spare capacity).
    /// Layers with spare capacity are strided views of their buffers.
    pub(crate) fn push_own(&mut self, l: usize, k: &Tensor, v: &Tensor) -> Result<LayerKv> {
        let Some(old) = &self.layers[l] else {
            let kv = LayerKv {
                k: k.clone(),
                v: v.clone(),
            };
            self.layers[l] = Some(kv.clone());
            self.spare[l] = None;
            return Ok(kv);
        };
        let have = old.k.dim(2)?;
        let n = k.dim(2)?;
        let fits = matches!(&self.spare[l], Some((kb, _)) if kb.dim(2)? >= have + n);
        // Writes into spare capacity are invisible to autograd: entries that
        // carry a gradient (a bridge's training step) are always joined.
        let grad = k.track_op() || v.track_op() || old.k.track_op() || old.v.track_op();
        if grad || (!fits && n > SLACK) {
            // A long call (a passage read on top of a prefix) is not a
            // decoding step: the entries are joined exactly, with no spare.
            let kv = LayerKv {
                k: Tensor::cat(&[&old.k, k], 2)?,
                v: Tensor::cat(&[&old.v, v], 2)?,
            };
            self.layers[l] = Some(kv.clone());
            self.spare[l] = None;
            return Ok(kv);
        }
        if !fits {
            let (b, h, _, d) = k.dims4()?;
            let pad = Tensor::zeros((b, h, SLACK.max(n), d), k.dtype(), k.device())?;
            // Contiguous buffers: later steps write into them in place
            // (`cat` of a strided view may return a transposed layout).
            let kb = Tensor::cat(&[&old.k, k, &pad], 2)?.contiguous()?;
            let vb = Tensor::cat(&[&old.v, v, &pad], 2)?.contiguous()?;
            self.spare[l] = Some((kb, vb));
        } else if let Some((kb, vb)) = &self.spare[l] {
            kb.slice_set(&k.contiguous()?, 2, have)?;
            vb.slice_set(&v.contiguous()?, 2, have)?;
        }
        let (kb, vb) = self.spare[l]
            .as_ref()
            .expect("spare capacity was just made");
        let kv = LayerKv {
            k: kb.narrow(2, 0, have + n)?,
            v: vb.narrow(2, 0, have + n)?,
        };
        self.layers[l] = Some(kv.clone());
        Ok(kv)
    }

    /// Records that `n` own tokens were added to every layer (forward use);
    /// in a padded batch, sequence `i`'s first `lens[i]` of them are real
    /// and the rest padding (`None`: all real).
    pub(crate) fn advance_own(&mut self, n: usize, lens: Option<&[usize]>) {
        if let Some(rows) = &mut self.rows {
            for (i, (valid, next)) in rows.valid.iter_mut().zip(rows.next.iter_mut()).enumerate() {
                let real = lens.map_or(n, |l| l[i]);
                valid.extend((0..n).map(|j| j < real));
                *next += real;
            }
        }
        let start = self.len();
        match self.segments.last_mut() {
            Some(s) if s.kind == SegmentKind::Own => s.len += n,
            _ => self.segments.push(Segment {
                kind: SegmentKind::Own,
                start,
                len: n,
            }),
        }
        self.next_position += n;
    }

    /// Appends another cache's entries as an extra attendable segment in every
    /// layer (augmentation). They keep their own RoPE; positions do not advance.
    pub fn append_segment(&mut self, other: &KvCache) -> Result<()> {
        self.refuse_padded("append")?;
        other.refuse_padded("append")?;
        if other.n_layers() != self.n_layers()
            || other.n_kv_heads != self.n_kv_heads
            || other.head_dim != self.head_dim
        {
            return Err(RuntimeError::BadIntervention {
                site: "kv cache append".into(),
                reason: format!(
                    "cache shapes differ: {} layers x {} kv heads x {} head_dim against {} x {} x {}",
                    other.n_layers(), other.n_kv_heads, other.head_dim,
                    self.n_layers(), self.n_kv_heads, self.head_dim
                ),
            });
        }
        if other.batch != self.batch {
            return Err(RuntimeError::BadIntervention {
                site: "kv cache append".into(),
                reason: format!("batch {} against {}", other.batch, self.batch),
            });
        }
        if other.is_empty() {
            return Ok(());
        }
        for l in 0..self.n_layers() {
            self.spare[l] = None;
            let add = other.require_layer(l)?;
            self.layers[l] = Some(match &self.layers[l] {
                None => add.clone(),
                Some(old) => LayerKv {
                    k: Tensor::cat(&[&old.k, &add.k], 2)?,
                    v: Tensor::cat(&[&old.v, &add.v], 2)?,
                },
            });
        }
        let start = self.len();
        self.segments.push(Segment {
            kind: SegmentKind::Appended,
            start,
            len: other.len(),
        });
        Ok(())
    }

    /// The first `len` entries (must end inside the first own segment or at a
    /// segment boundary), e.g. the passage prefix of a prompt's cache.
    pub fn truncate(&self, len: usize) -> Result<KvCache> {
        self.narrow(0, len)
    }

    /// Entries `start..start+len` of every layer as a cache of their own.
    /// Positions: the result's next position is where its last own entry
    /// would continue.
    pub fn narrow(&self, start: usize, len: usize) -> Result<KvCache> {
        self.refuse_padded("narrow")?;
        if start + len > self.len() {
            return Err(RuntimeError::BadIntervention {
                site: "kv cache narrow".into(),
                reason: format!(
                    "entries {start}..{} outside a cache of {}",
                    start + len,
                    self.len()
                ),
            });
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for kv in &self.layers {
            layers.push(match kv {
                Some(kv) if len > 0 => Some(LayerKv {
                    k: kv.k.narrow(2, start, len)?,
                    v: kv.v.narrow(2, start, len)?,
                }),
                _ => None,
            });
        }
        // Re-derive segments and positions.
        let mut segments = Vec::new();
        let mut own_before_end = 0;
        let end = start + len;
        for s in &self.segments {
            let a = s.start.max(start);
            let b = (s.start + s.len).min(end);
            if s.kind == SegmentKind::Own {
                own_before_end += s.len.min(end.saturating_sub(s.start));
            }
            if a < b {
                segments.push(Segment {
                    kind: s.kind,
                    start: a - start,
                    len: b - a,
                });
            }
        }
        Ok(KvCache {
            spare: vec![None; layers.len()],
            layers,
            batch: self.batch,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            next_position: own_before_end,
            segments,
            rows: None,
            device: self.device.clone(),
        })
    }

    /// The first of caches to stack, or an error saying there are none.
    fn first_of<'a>(caches: &[&'a KvCache]) -> Result<&'a KvCache> {
        caches
            .first()
            .copied()
            .ok_or_else(|| RuntimeError::BadIntervention {
                site: "kv cache stack".into(),
                reason: "no caches to stack".into(),
            })
    }

    /// Whether two caches hold entries of one shape (layers, kv heads,
    /// head_dim), whatever their lengths.
    fn same_shape(&self, other: &KvCache) -> bool {
        self.n_layers() == other.n_layers()
            && self.n_kv_heads == other.n_kv_heads
            && self.head_dim == other.head_dim
    }

    /// Stacks caches of equal layout along the batch axis, so one forward serves them all.
    pub fn stack(caches: &[&KvCache]) -> Result<KvCache> {
        let first = Self::first_of(caches)?;
        for c in caches {
            c.refuse_padded("stack")?;
            if c.segments != first.segments
                || c.next_position != first.next_position
                || !c.same_shape(first)
            {
                return Err(RuntimeError::BadIntervention {
                    site: "kv cache stack".into(),
                    reason: "caches differ in layout (length, segments or shape)".into(),
                });
            }
        }
        let mut layers = Vec::with_capacity(first.n_layers());
        for l in 0..first.n_layers() {
            if first.layers[l].is_none() {
                layers.push(None);
                continue;
            }
            let ks: Vec<&Tensor> = caches
                .iter()
                .map(|c| &c.layers[l].as_ref().unwrap().k)
                .collect();
            let vs: Vec<&Tensor> = caches
                .iter()
                .map(|c| &c.layers[l].as_ref().unwrap().v)
                .collect();
            layers.push(Some(LayerKv {
                k: Tensor::cat(&ks, 0)?,
                v: Tensor::cat(&vs, 0)?,
            }));
        }
        Ok(KvCache {
            layers,
            batch: caches.iter().map(|c| c.batch).sum(),
            ..(*first).clone()
        })
    }

    /// Repeats a batch-1 cache `n` times along the batch axis.
    pub fn repeat(&self, n: usize) -> Result<KvCache> {
        let refs: Vec<&KvCache> = std::iter::repeat_n(self, n).collect();
        Self::stack(&refs)
    }

    /// Sequence `b` of the batch as a batch-1 cache (of a padded batch: with
    /// its padding, still a padded cache).
    pub fn select(&self, b: usize) -> Result<KvCache> {
        if b >= self.batch {
            return Err(RuntimeError::BadIntervention {
                site: "kv cache select".into(),
                reason: format!("sequence {b} outside a batch of {}", self.batch),
            });
        }
        let mut out = self.clone();
        out.batch = 1;
        for kv in out.layers.iter_mut().flatten() {
            kv.k = kv.k.narrow(0, b, 1)?;
            kv.v = kv.v.narrow(0, b, 1)?;
        }
        if let Some(rows) = &self.rows {
            out.rows = Some(RowLayout {
                valid: vec![rows.valid[b].clone()],
                next: vec![rows.next[b]],
            });
        }
        Ok(out)
    }

    /// Stacks caches of any lengths and layouts along the batch axis, each
    /// padded at its end to the longest: one forward then reads every
    /// sequence's question and decodes them together, each sequence
    /// attending to its own entries only and placing its new tokens at its
    /// own next position. Caches of one layout are stacked as
    /// [`KvCache::stack`] does, without padding.
    pub fn stack_padded(caches: &[&KvCache]) -> Result<KvCache> {
        let first = Self::first_of(caches)?;
        if caches
            .iter()
            .all(|c| c.segments == first.segments && c.next_position == first.next_position)
        {
            return Self::stack(caches);
        }
        let longest = caches.iter().map(|c| c.len()).max().unwrap_or(0);
        let mut valid = Vec::new();
        let mut next = Vec::new();
        for c in caches {
            c.refuse_padded("stack")?;
            if !c.same_shape(first) {
                return Err(RuntimeError::BadIntervention {
                    site: "kv cache stack".into(),
                    reason: "caches differ in shape (layers, kv heads or head_dim)".into(),
                });
            }
            if c.is_empty() {
                return Err(RuntimeError::BadIntervention {
                    site: "kv cache stack".into(),
                    reason: "an empty cache cannot be padded into a batch".into(),
                });
            }
            for _ in 0..c.batch {
                valid.push((0..longest).map(|j| j < c.len()).collect());
                next.push(c.next_position);
            }
        }
        let mut layers = Vec::with_capacity(first.n_layers());
        for l in 0..first.n_layers() {
            let mut ks = Vec::with_capacity(caches.len());
            let mut vs = Vec::with_capacity(caches.len());
            for c in caches {
                let kv = c.require_layer(l)?;
                let pad = longest - c.len();
                if pad == 0 {
                    ks.push(kv.k.clone());
                    vs.push(kv.v.clone());
                } else {
                    ks.push(kv.k.pad_with_zeros(2, 0, pad)?);
                    vs.push(kv.v.pad_with_zeros(2, 0, pad)?);
                }
            }
            layers.push(Some(LayerKv {
                k: Tensor::cat(&ks, 0)?,
                v: Tensor::cat(&vs, 0)?,
            }));
        }
        Ok(KvCache {
            spare: vec![None; layers.len()],
            layers,
            batch: caches.iter().map(|c| c.batch).sum(),
            n_kv_heads: first.n_kv_heads,
            head_dim: first.head_dim,
            next_position: 0,
            segments: vec![Segment {
                kind: SegmentKind::Own,
                start: 0,
                len: longest,
            }],
            rows: Some(RowLayout { valid, next }),
            device: first.device.clone(),
        })
    }

    /// Makes this cache a padded batch whose sequences share its layout
    /// (every entry valid, one next position), so that prompts of different
    /// lengths can be read on it.
    pub(crate) fn share_layout_as_rows(&mut self) {
        if self.rows.is_none() {
            self.rows = Some(RowLayout {
                valid: vec![vec![true; self.len()]; self.batch],
                next: vec![self.next_position; self.batch],
            });
        }
    }

    /// Undoes [`KvCache::share_layout_as_rows`] on a cache nothing was
    /// written to since (a refused call).
    pub(crate) fn unshare_layout(&mut self) {
        self.rows = None;
    }

    /// Per sequence, whether each of the cache's entries followed by `s`
    /// new ones (the first `lens[i]` of them real) may be attended to;
    /// `None` for a cache whose sequences share one layout.
    pub(crate) fn key_validity(&self, s: usize, lens: Option<&[usize]>) -> Option<Vec<bool>> {
        let rows = self.rows.as_ref()?;
        let mut out = Vec::with_capacity(rows.valid.len() * (self.len() + s));
        for (i, v) in rows.valid.iter().enumerate() {
            out.extend_from_slice(v);
            let real = lens.map_or(s, |l| l[i]);
            out.extend((0..s).map(|j| j < real));
        }
        Some(out)
    }

    /// Per sequence, the RoPE positions of `s` new tokens; `None` for a cache
    /// whose sequences share one layout.
    pub(crate) fn row_positions(&self, s: usize) -> Option<Vec<u32>> {
        let rows = self.rows.as_ref()?;
        Some(
            rows.next
                .iter()
                .flat_map(|&p| (p..p + s).map(|x| x as u32))
                .collect(),
        )
    }
}
