//! Runs: the project home, the run/log database, JSON values, run ids and
//! dates, the adaptive checkpoint policy, replay plans and resume selection.

pub mod adaptive;
pub mod cpu;
pub mod dates;
pub mod db;
pub mod files;
pub mod ids;
pub mod json;
pub mod lease;
pub mod preempt;
pub mod project;
pub mod ranks;
pub mod relocate;
pub mod remove;
pub mod replay;
pub mod resume;
pub mod schedule;
pub mod session;
pub mod store_choice;
pub mod supervise;
