//! Rows about a run's resources beyond their hashes: what a resource
//! reports of how it was fitted (a bridge's training curve), long format,
//! in the run folder's `resources.parquet`.

use crate::record;

record! {
    /// One value a resource reports about its fitting.
    #[derive(Debug, Clone, PartialEq)]
    pub struct ResourceRow {
        /// Run name.
        pub run: String,
        /// The resource's name in the config (`[resources.<name>]`).
        pub resource: String,
        /// Its kind (`bridge`, ...).
        pub kind: String,
        /// Its content hash.
        pub hash: String,
        /// The training epoch the value belongs to (0: before any step); null when not per epoch.
        pub epoch: Option<i64>,
        /// What is measured: for bridges `train_loss` (mean over the epoch's steps), `slice_loss`, `slice_first_token_accuracy`, `kept` (1 on the kept epoch).
        pub metric: String,
        /// The value.
        pub value: f64,
    }
}
