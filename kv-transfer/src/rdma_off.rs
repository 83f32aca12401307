//! The RDMA transport when tandem is built without the `rdma` feature: the same names, each
//! answering that RDMA is not compiled in, so no `cfg` leaks out of `lib.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::core::Timeouts;
use crate::wire::{KvEvent, Layers, Local};
use crate::{KvRegions, TransferError, TransferStats};

const OFF: &str = "tandem was built without the `rdma` feature";

/// Why RDMA cannot be used: it is not compiled in.
pub fn probe() -> Result<Vec<String>, String> {
    Err(OFF.into())
}

/// Never constructed in this build.
pub enum RdmaKvReceiver {}

impl RdmaKvReceiver {
    /// Always fails: RDMA is not compiled in.
    ///
    /// # Safety
    /// None needed here; the signature matches the real transport's.
    pub unsafe fn bind(_: TcpListener, _: &KvRegions) -> Result<RdmaKvReceiver, TransferError> {
        Err(TransferError::Refused(OFF.into()))
    }

    /// Unreachable: no receiver exists.
    pub fn local_addr(&self) -> Result<SocketAddr, TransferError> {
        match *self {}
    }

    /// Unreachable: no receiver exists.
    pub async fn serve(self, _: Local, _: mpsc::Sender<KvEvent>, _: Timeouts) {
        match self {}
    }
}

/// Never constructed in this build.
pub enum RdmaKvSender {}

impl RdmaKvSender {
    /// Always fails: RDMA is not compiled in.
    pub async fn connect(_: &str, _: &Local, _: Duration) -> Result<RdmaKvSender, TransferError> {
        Err(TransferError::Refused(OFF.into()))
    }

    /// Unreachable: no sender exists.
    pub async fn send(
        &mut self,
        _: (u64, types::TransferTicket),
        _: u32,
        _: u32,
        _: Layers<'_>,
        _: Duration,
    ) -> Result<TransferStats, TransferError> {
        match *self {}
    }
}
