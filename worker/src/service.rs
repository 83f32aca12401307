//! The `Worker` gRPC service every worker serves (cancel, drain, stats), and the guard that
//! releases a request when the call holding it ends.

use proto::grpc::worker_server::{Worker, WorkerServer};
use proto::grpc::{CancelReply, CancelRequest, DrainReply, DrainRequest, StatsRequest, WorkerLoad};
use tonic::{Request, Response, Status};
use types::RequestId;

use crate::engine_thread::EngineHandle;

/// The `Worker` service over an engine thread.
pub struct WorkerService<C>(EngineHandle<C>);

/// The service, ready to add to a gRPC server.
pub fn server<C: Send + 'static>(engine: EngineHandle<C>) -> WorkerServer<WorkerService<C>> {
    WorkerServer::new(WorkerService(engine))
}

#[tonic::async_trait]
impl<C: Send + 'static> Worker for WorkerService<C> {
    async fn cancel(&self, req: Request<CancelRequest>) -> Result<Response<CancelReply>, Status> {
        let found = self
            .0
            .cancel(RequestId(req.into_inner().request_id))
            .await?;
        Ok(Response::new(CancelReply { found }))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainReply>, Status> {
        self.0.drain()?;
        Ok(Response::new(DrainReply {}))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerLoad>, Status> {
        Ok(Response::new(self.0.load()))
    }
}

/// Releases request `id` on the engine thread when dropped: held by the gRPC call (or the
/// response stream) that owns the request, so a caller that goes away frees the request's
/// blocks at once, without the engine thread polling for it. Releasing a request that already
/// finished does nothing.
pub struct ReleaseOnDrop<C: Send + 'static> {
    engine: EngineHandle<C>,
    id: RequestId,
}

impl<C: Send + 'static> ReleaseOnDrop<C> {
    /// Guards request `id`.
    pub fn new(engine: &EngineHandle<C>, id: RequestId) -> Self {
        ReleaseOnDrop {
            engine: engine.clone(),
            id,
        }
    }
}

impl<C: Send + 'static> Drop for ReleaseOnDrop<C> {
    fn drop(&mut self) {
        self.engine.forget(self.id);
    }
}
