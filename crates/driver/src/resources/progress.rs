//! A bridge's training progress at the end of its last finished epoch, or
//! some steps into the next, kept beside the resource cache
//! (`<kind>-<hash>.progress.safetensors`) so that a training cut short (a
//! session's end, a killed process) resumes there instead of from the
//! start.
//!
//! The file holds what the rest of the training depends on: the parameters,
//! the optimizer's moments and step count, the slice curve so far, the kept
//! (best) epoch and its parameters, and inside an epoch the steps taken and
//! their summed loss. The epochs' shuffled orders are replayed from the
//! seed, so a resumed training gives the bits an uninterrupted one gives.
//! The resource hash in the file name covers the spec and the receiver;
//! the file is removed once the resource is saved. The file names
//! the parameters in training order (`layout`), so that a training whose
//! code orders them otherwise sets the file aside instead of reading one
//! parameter's values into another of the same shape; files written before
//! the names were kept are read by position, shapes checked. Files written
//! before steps inside an epoch were saved (three counts) are read as an
//! epoch's end; binaries of that time refuse the newer files (four counts)
//! and train from the start.

use super::optim::AdamState;
use crate::error::Result;
use candle_core::{Device, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// Training progress after `epoch` finished epochs and `steps` steps of
/// the next.
pub struct Progress {
    /// Epochs finished.
    pub epoch: usize,
    /// Steps taken of epoch `epoch + 1` (0 at an epoch's end).
    pub steps: usize,
    /// The training loss summed over the examples of those steps (the
    /// epoch's mean so far, times the examples seen).
    pub partial_loss: f64,
    /// The parameters' names, in training order: the keys the bridge's
    /// value file gives them (a layer's A and B of a projection, a
    /// router's W_q and W_k).
    pub names: Vec<String>,
    /// The parameters after `epoch` epochs and `steps` steps of the next,
    /// in training order.
    pub params: Vec<Tensor>,
    /// The optimizer's state at the same point.
    pub adam: AdamState,
    /// The parameters of the kept (best) epoch; `None` while the initial
    /// parameters are kept.
    pub kept: Option<Vec<Tensor>>,
    /// Per epoch (0 = before training): epoch, mean training loss, slice
    /// loss, slice first-token accuracy.
    pub curve: Vec<[f64; 4]>,
    /// The kept epoch.
    pub best_epoch: usize,
}

impl Progress {
    /// Writes the progress to `path` atomically (a temporary file, then a
    /// rename): a reader finds the previous save's file or this one.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (i, t) in self.params.iter().enumerate() {
            map.insert(format!("param.{i}"), t.clone());
        }
        for (i, t) in self.adam.first.iter().enumerate() {
            map.insert(format!("first.{i}"), t.clone());
        }
        for (i, t) in self.adam.second.iter().enumerate() {
            map.insert(format!("second.{i}"), t.clone());
        }
        for (i, t) in self.kept.iter().flatten().enumerate() {
            map.insert(format!("kept.{i}"), t.clone());
        }
        map.insert("curve".into(), curve_tensor(&self.curve)?);
        map.insert(
            "layout".into(),
            super::files::text_tensor(&self.names.join("\n"))?,
        );
        map.insert(
            "counts".into(),
            Tensor::new(
                &[
                    self.epoch as u32,
                    self.adam.step_t as u32,
                    self.best_epoch as u32,
                    self.steps as u32,
                ],
                &Device::Cpu,
            )?,
        );
        map.insert(
            "partial_loss".into(),
            Tensor::new(&[self.partial_loss], &Device::Cpu)?,
        );
        // Synced: a machine that stops, not only a killed process, leaves
        // the previous save's file or this one.
        super::files::save_atomic(&map, path, true)
    }

    /// The progress at `path` for training `params`, named `names`, over at
    /// most `epochs` epochs: `Ok(None)` when there is none, `Err(why)` inside
    /// `Ok` when the file is there but cannot be used (unreadable, other
    /// parameter names or shapes, more epochs than the training has).
    pub fn load(
        path: &Path,
        names: &[String],
        params: &[Var],
        epochs: usize,
    ) -> Result<Option<std::result::Result<Progress, String>>> {
        if !path.exists() {
            return Ok(None);
        }
        Ok(Some(Self::read(path, names, params, epochs)))
    }

    /// This progress, when its steps fit a training of `steps_per_epoch`
    /// steps an epoch: fewer steps than an epoch has, and the optimizer's
    /// step count the finished epochs' and steps' sum; why not otherwise.
    pub fn fits(self, steps_per_epoch: usize) -> std::result::Result<Progress, String> {
        let want = self.epoch * steps_per_epoch + self.steps;
        if self.steps >= steps_per_epoch.max(1) || self.adam.step_t != want {
            return Err(format!(
                "{} steps into epoch {} and {} optimizer steps, where an epoch has {steps_per_epoch} steps ({want} expected)",
                self.steps,
                self.epoch + 1,
                self.adam.step_t
            ));
        }
        Ok(self)
    }

    fn read(
        path: &Path,
        names: &[String],
        params: &[Var],
        epochs: usize,
    ) -> std::result::Result<Progress, String> {
        debug_assert_eq!(names.len(), params.len(), "a name for every parameter");
        let map = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| e.to_string())?;
        let get = |k: &str| {
            map.get(k)
                .cloned()
                .ok_or_else(|| format!("no tensor `{k}`"))
        };
        // A file that names its parameters must name the training's, in
        // order; one without a layout (older binaries) is read by position.
        if let Some(layout) = map.get("layout") {
            let saved = super::files::tensor_text(layout, "layout")?;
            let saved: Vec<&str> = match saved.as_str() {
                "" => Vec::new(),
                s => s.split('\n').collect(),
            };
            let want: Vec<&str> = names.iter().map(String::as_str).collect();
            if saved != want {
                let show = |v: &[&str]| match v {
                    [] => "none".to_string(),
                    [one] => one.to_string(),
                    [first, .., last] => format!("{first} .. {last} ({})", v.len()),
                };
                let at = saved
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(saved.len().min(want.len()));
                let name = |v: &[&str]| v.get(at).copied().unwrap_or("(end)").to_string();
                return Err(format!(
                    "its parameters are {}, the training's {}; at position {at} it has {}, the training {}",
                    show(&saved),
                    show(&want),
                    name(&saved),
                    name(&want)
                ));
            }
        }
        let counts = get("counts")?.to_vec1::<u32>().map_err(|e| e.to_string())?;
        // Files written before steps inside an epoch were saved hold three
        // counts: an epoch's end.
        let (epoch, step_t, best_epoch, steps) = match counts[..] {
            [e, t, b] => (e, t, b, 0),
            [e, t, b, s] => (e, t, b, s),
            _ => {
                return Err(format!(
                    "`counts` holds {} values, not 3 or 4",
                    counts.len()
                ))
            }
        };
        let (epoch, best_epoch, steps) = (epoch as usize, best_epoch as usize, steps as usize);
        // The summed loss of the steps taken: one finite value, zero at an
        // epoch's end (it is added to the resumed epoch's mean).
        let partial_loss = match map.get("partial_loss") {
            Some(t) => match t.to_vec1::<f64>().map_err(|e| format!("`partial_loss`: {e}"))?[..] {
                [v] if v.is_finite() && (steps > 0 || v == 0.0) => v,
                ref other => {
                    return Err(format!(
                        "`partial_loss` is {other:?} after {steps} steps of an epoch, not one finite sum (zero at an epoch's end)"
                    ))
                }
            },
            None if steps == 0 => 0.0,
            None => {
                return Err(format!(
                    "{steps} steps into an epoch without `partial_loss`"
                ))
            }
        };
        let curve = curve_rows(&get("curve")?)?;
        if epoch > epochs
            || (steps > 0 && epoch == epochs)
            || curve.len() != epoch + 1
            || best_epoch > epoch
        {
            return Err(format!(
                "{epoch} epochs finished of {epochs} and {steps} steps of the next, {} curve rows, kept epoch {best_epoch}",
                curve.len()
            ));
        }
        let list = |tag: &str| -> std::result::Result<Vec<Tensor>, String> {
            params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let t = get(&format!("{tag}.{i}"))?;
                    if t.dims() != p.dims() || t.dtype() != p.dtype() {
                        return Err(format!(
                            "`{tag}.{i}` is {:?} {:?}, the parameter is {:?} {:?}",
                            t.dtype(),
                            t.dims(),
                            p.dtype(),
                            p.dims()
                        ));
                    }
                    Ok(t)
                })
                .collect()
        };
        let n_params = map.keys().filter(|k| k.starts_with("param.")).count();
        if n_params != params.len() {
            return Err(format!(
                "{n_params} parameters saved, the training has {}",
                params.len()
            ));
        }
        Ok(Progress {
            epoch,
            steps,
            partial_loss,
            names: names.to_vec(),
            params: list("param")?,
            adam: AdamState {
                first: list("first")?,
                second: list("second")?,
                step_t: step_t as usize,
            },
            kept: if best_epoch > 0 {
                Some(list("kept")?)
            } else {
                None
            },
            curve,
            best_epoch,
        })
    }
}

/// A training curve (per epoch: epoch, mean training loss, slice loss,
/// slice first-token accuracy) as the (epochs + 1, 4) f64 tensor a bridge's
/// value file and its progress file hold.
pub fn curve_tensor(curve: &[[f64; 4]]) -> Result<Tensor> {
    let flat: Vec<f64> = curve.iter().flatten().copied().collect();
    Ok(Tensor::from_vec(flat, (curve.len(), 4), &Device::Cpu)?)
}

/// The curve a tensor written by [`curve_tensor`] holds; why not, when it
/// is not (epochs + 1, 4) f64.
pub fn curve_rows(t: &Tensor) -> std::result::Result<Vec<[f64; 4]>, String> {
    if t.dims().len() != 2 || t.dims()[1] != 4 {
        return Err(format!("`curve` is {:?}, not (epochs + 1, 4)", t.dims()));
    }
    Ok(t.to_vec2::<f64>()
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|r| [r[0], r[1], r[2], r[3]])
        .collect())
}
