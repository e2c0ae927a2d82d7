//! Where an arm acts: which carrier, which layers, which positions, and by
//! which mechanism the source enters.

use crate::error::{CarrierError, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// The object shared between holder and receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Carrier {
    /// Post-RoPE keys (`blocks.{l}.attn.hook_rot_k`).
    K,
    /// Values (`blocks.{l}.attn.hook_v`).
    V,
    /// Keys and values together.
    Kv,
    /// The residual stream at the input of block l (`blocks.{l}.hook_resid_pre`).
    H,
}

impl Carrier {
    /// Whether this carrier lives in the KV cache.
    pub fn is_kv(self) -> bool {
        !matches!(self, Carrier::H)
    }

    /// Whether keys are part of the carrier.
    pub fn has_k(self) -> bool {
        matches!(self, Carrier::K | Carrier::Kv)
    }

    /// Whether values are part of the carrier.
    pub fn has_v(self) -> bool {
        matches!(self, Carrier::V | Carrier::Kv)
    }

    /// Short name used in records (`k`, `v`, `kv`, `h`).
    pub fn name(self) -> &'static str {
        match self {
            Carrier::K => "k",
            Carrier::V => "v",
            Carrier::Kv => "kv",
            Carrier::H => "h",
        }
    }
}

/// A set of layers, written in configs as `"all"`, a layer number (`12`), a
/// list (`[4, 8, 12]`), `"prefix:8"` (the first 8 layers, 0..8) or
/// `"suffix:12"` (layer 12 to the last).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LayerSet {
    /// Every layer.
    All,
    /// These layers (0-based).
    List(Vec<usize>),
    /// The first `n` layers (0..n): the protocol's prefix 1..l.
    Prefix(usize),
    /// Layer `l` and every layer after it (l..L).
    Suffix(usize),
}

impl LayerSet {
    /// The layers, sorted, for a model of `n_layers`; `field` names the
    /// config field in errors.
    pub fn resolve(&self, n_layers: usize, field: &str) -> Result<Vec<usize>> {
        let out: Vec<usize> = match self {
            LayerSet::All => (0..n_layers).collect(),
            LayerSet::List(v) => {
                let mut v = v.clone();
                v.sort_unstable();
                v.dedup();
                v
            }
            LayerSet::Prefix(n) => {
                if *n == 0 || *n > n_layers {
                    return Err(CarrierError::LayerOutOfRange {
                        field: field.into(),
                        layer: n.saturating_sub(1).max(*n),
                        n_layers,
                    });
                }
                (0..*n).collect()
            }
            LayerSet::Suffix(l) => (*l..n_layers.max(*l + 1)).collect(),
        };
        if out.is_empty() {
            return Err(CarrierError::BadSites {
                field: field.into(),
                reason: "the layer set is empty".into(),
            });
        }
        if let Some(&bad) = out.iter().find(|&&l| l >= n_layers) {
            return Err(CarrierError::LayerOutOfRange {
                field: field.into(),
                layer: bad,
                n_layers,
            });
        }
        Ok(out)
    }

    /// The lowest layer named (for plots against depth); `None` for `All`.
    pub fn first(&self) -> Option<usize> {
        match self {
            LayerSet::All => None,
            LayerSet::List(v) => v.iter().min().copied(),
            LayerSet::Prefix(_) => Some(0),
            LayerSet::Suffix(l) => Some(*l),
        }
    }
}

impl fmt::Display for LayerSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerSet::All => write!(f, "all"),
            LayerSet::List(v) => {
                let s: Vec<String> = v.iter().map(|l| l.to_string()).collect();
                write!(f, "{}", s.join(","))
            }
            LayerSet::Prefix(n) => write!(f, "prefix:{n}"),
            LayerSet::Suffix(l) => write!(f, "suffix:{l}"),
        }
    }
}

impl std::str::FromStr for LayerSet {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let num = |t: &str| -> std::result::Result<usize, String> {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{t}` is not a layer number"))
        };
        if s == "all" {
            Ok(LayerSet::All)
        } else if let Some(n) = s.strip_prefix("prefix:") {
            Ok(LayerSet::Prefix(num(n)?))
        } else if let Some(l) = s.strip_prefix("suffix:") {
            Ok(LayerSet::Suffix(num(l)?))
        } else if !s.is_empty() {
            Ok(LayerSet::List(
                s.split(',')
                    .map(num)
                    .collect::<std::result::Result<_, _>>()?,
            ))
        } else {
            Err(
                "an empty layer set; write \"all\", a layer, a list, \"prefix:N\" or \"suffix:L\""
                    .into(),
            )
        }
    }
}

impl Serialize for LayerSet {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            LayerSet::List(v) if v.len() == 1 => s.serialize_u64(v[0] as u64),
            other => s.serialize_str(&other.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for LayerSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = LayerSet;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a layer set: \"all\", a layer number, a list of layers, \"prefix:N\" or \"suffix:L\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<LayerSet, E> {
                Ok(LayerSet::List(vec![v as usize]))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<LayerSet, E> {
                if v < 0 {
                    return Err(E::custom(format!("layer {v} is negative")));
                }
                Ok(LayerSet::List(vec![v as usize]))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<LayerSet, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<LayerSet, A::Error> {
                let mut out = Vec::new();
                while let Some(l) = seq.next_element::<usize>()? {
                    out.push(l);
                }
                if out.is_empty() {
                    return Err(serde::de::Error::custom("an empty layer list"));
                }
                Ok(LayerSet::List(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// Which prompt positions an injection touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Positions {
    /// Every context position (template prefix and passage).
    All,
    /// The passage positions.
    Passage,
    /// The fact region: passage positions whose ids differ between the
    /// full and the masked passage.
    #[default]
    FactRegion,
    /// The position control's sites: as many positions as the fact region
    /// has, from the fact-free common prefix, nearest the first fact position.
    FactFreePrefix,
    /// The whole fact-free common prefix.
    CommonPrefix,
    /// Every context position after the first fact position (the
    /// downstream positions of an edit, Mode D).
    Downstream,
}

impl Positions {
    /// Short name used in records.
    pub fn name(self) -> &'static str {
        match self {
            Positions::All => "all",
            Positions::Passage => "passage",
            Positions::FactRegion => "fact_region",
            Positions::FactFreePrefix => "fact_free_prefix",
            Positions::CommonPrefix => "common_prefix",
            Positions::Downstream => "downstream",
        }
    }

    /// The prompt positions of this set for an item of geometry `g`, sorted.
    pub fn resolve(self, g: &Geometry) -> Vec<usize> {
        let common = g.common_prefix_len();
        match self {
            Positions::All => (0..g.context_len).collect(),
            Positions::Passage => (g.passage_start..g.context_len).collect(),
            Positions::FactRegion => g.fact.clone(),
            Positions::FactFreePrefix => {
                let k = g.fact.len().min(common - g.passage_start);
                (common - k..common).collect()
            }
            Positions::CommonPrefix => (0..common).collect(),
            Positions::Downstream => (common..g.context_len).collect(),
        }
    }
}

/// The layout of one item's context: where the passage starts, how long the
/// context (template prefix and passage) is, and the fact region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    /// Prompt position of the first passage token.
    pub passage_start: usize,
    /// Tokens before the question (template prefix and passage).
    pub context_len: usize,
    /// Fact region as prompt positions, sorted.
    pub fact: Vec<usize>,
}

impl Geometry {
    /// Positions before the first fact position (all of the context if there is none).
    pub fn common_prefix_len(&self) -> usize {
        self.fact.first().copied().unwrap_or(self.context_len)
    }
}

/// How the source enters the receiver's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mechanism {
    /// Substitution: the source takes the slots.
    Replace,
    /// `(1 - alpha) * own + alpha * source` in the slots.
    Interpolate,
    /// `own + alpha * source` (the residual carrier's augmentation).
    Add,
    /// Augmentation of the cache: the source's keys and values become extra
    /// attendable segments; the receiver keeps its own.
    Append,
}

impl Mechanism {
    /// Short name used in records.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Replace => "replace",
            Mechanism::Interpolate => "interpolate",
            Mechanism::Add => "add",
            Mechanism::Append => "append",
        }
    }

    /// Whether the mechanism takes a weight `alpha`.
    pub fn takes_alpha(self) -> bool {
        matches!(self, Mechanism::Interpolate | Mechanism::Add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct W {
        layers: LayerSet,
    }

    #[test]
    fn layer_sets_round_trip_through_toml() {
        for (text, want) in [
            ("layers = \"all\"", LayerSet::All),
            ("layers = 12", LayerSet::List(vec![12])),
            ("layers = [4, 8]", LayerSet::List(vec![4, 8])),
            ("layers = \"prefix:8\"", LayerSet::Prefix(8)),
            ("layers = \"suffix:12\"", LayerSet::Suffix(12)),
            ("layers = \"4,8\"", LayerSet::List(vec![4, 8])),
        ] {
            let w: W = toml::from_str(text).unwrap();
            assert_eq!(w.layers, want, "{text}");
            let back: W = toml::from_str(&toml::to_string(&w).unwrap()).unwrap();
            assert_eq!(back, w);
        }
        let err = toml::from_str::<W>("layers = \"sufix:3\"").unwrap_err();
        assert!(err.to_string().contains("sufix:3"), "{err}");
    }

    #[test]
    fn layer_sets_resolve_and_reject_out_of_range() {
        assert_eq!(LayerSet::Prefix(3).resolve(24, "x").unwrap(), vec![0, 1, 2]);
        assert_eq!(LayerSet::Suffix(22).resolve(24, "x").unwrap(), vec![22, 23]);
        assert_eq!(LayerSet::All.resolve(2, "x").unwrap(), vec![0, 1]);
        let e = LayerSet::List(vec![4, 30])
            .resolve(24, "arms[2].inject.layers")
            .unwrap_err();
        assert!(
            e.to_string().contains("layer 30") && e.to_string().contains("arms[2].inject.layers")
        );
        assert!(LayerSet::Suffix(24).resolve(24, "x").is_err());
        assert!(LayerSet::Prefix(25).resolve(24, "x").is_err());
    }

    #[test]
    fn positions_resolve_on_a_geometry() {
        let g = Geometry {
            passage_start: 3,
            context_len: 20,
            fact: vec![10, 11, 15],
        };
        assert_eq!(Positions::FactRegion.resolve(&g), vec![10, 11, 15]);
        assert_eq!(Positions::FactFreePrefix.resolve(&g), vec![7, 8, 9]);
        assert_eq!(
            Positions::CommonPrefix.resolve(&g),
            (0..10).collect::<Vec<_>>()
        );
        assert_eq!(Positions::Passage.resolve(&g), (3..20).collect::<Vec<_>>());
        assert_eq!(
            Positions::Downstream.resolve(&g),
            (10..20).collect::<Vec<_>>()
        );
        // A fact region that starts at the passage start leaves no prefix sites.
        let g2 = Geometry {
            fact: vec![3, 4],
            ..g
        };
        assert!(Positions::FactFreePrefix.resolve(&g2).is_empty());
    }
}
