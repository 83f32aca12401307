//! Owned RDMA verbs objects over `ibverbs-sys`, in rust-ibverbs' style: every object holds its
//! parent by `Arc` (so a queue pair cannot outlive its protection domain or device context),
//! queue pairs are prepared, then connected, and only the posting calls are `unsafe`.
//!
//! The `ibverbs` crate's newest release (0.9.2) posts only two-sided SENDs and cannot register
//! memory it did not allocate; one-sided WRITEs into the decode worker's KV pool need both, so
//! the data path calls the same project's FFI crate directly.

use std::ffi::CStr;
use std::io;
use std::sync::Arc;

use ibverbs_sys as ffi;

/// The port every queue pair uses.
const PORT: u8 = 1;

fn errno(rc: i32, what: &str) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        let e = io::Error::from_raw_os_error(rc.abs());
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

fn null<T>(p: *mut T, what: &str) -> io::Result<*mut T> {
    if p.is_null() {
        let e = io::Error::last_os_error();
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    } else {
        Ok(p)
    }
}

/// An open device: its context, the port's LID and the GID used for routing (RoCE).
pub struct Context {
    ctx: *mut ffi::ibv_context,
    name: String,
    lid: u16,
    gid: Option<[u8; 16]>,
    gid_index: u8,
}

// SAFETY: an ibv_context is documented thread-safe by libibverbs; this type only reads it.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the first RDMA device (or the one named by `TANDEM_RDMA_DEVICE`), using GID index
    /// `TANDEM_RDMA_GID_INDEX` (default 0) for RoCE routing.
    pub fn open() -> io::Result<Arc<Context>> {
        let want = std::env::var("TANDEM_RDMA_DEVICE").ok();
        let gid_index: u8 = std::env::var("TANDEM_RDMA_GID_INDEX")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; the list is freed below.
        let list = null(
            unsafe { ffi::ibv_get_device_list(&mut n) },
            "ibv_get_device_list",
        )?;
        // SAFETY: the list holds `n` valid device pointers until it is freed.
        let devices = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let mut chosen = None;
        for &d in devices {
            // SAFETY: `d` is a device of the live list; the name is a NUL-terminated string.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d)) }
                .to_string_lossy()
                .into_owned();
            if want.as_deref().is_none_or(|w| w == name) {
                chosen = Some((d, name));
                break;
            }
        }
        let opened = chosen.map(|(d, name)| {
            // SAFETY: `d` is a live device; the context outlives the list by design.
            (unsafe { ffi::ibv_open_device(d) }, name)
        });
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        let (ctx, name) = opened.ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "no RDMA device on this machine")
        })?;
        let ctx = null(ctx, "ibv_open_device")?;
        let mut port = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; `port` is a valid out-pointer of the layout libibverbs expects.
        let rc = unsafe { ffi::ibv_query_port(ctx, PORT, &mut port as *mut _ as *mut _) };
        errno(rc, "ibv_query_port")?;
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: as above.
        let gid = match unsafe { ffi::ibv_query_gid(ctx, PORT, gid_index as i32, &mut gid) } {
            // SAFETY: the union was filled by ibv_query_gid; `raw` covers all 16 bytes.
            0 => Some(unsafe { gid.raw }).filter(|g| g.iter().any(|&b| b != 0)),
            _ => None,
        };
        Ok(Arc::new(Context {
            ctx,
            name,
            lid: port.lid,
            gid,
            gid_index,
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child holds an Arc to this context, so none is left.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

/// A protection domain.
pub struct Pd {
    ctx: Arc<Context>,
    pd: *mut ffi::ibv_pd,
}

// SAFETY: protection domains are thread-safe in libibverbs.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<Pd>> {
        // SAFETY: the context is open.
        let pd = null(unsafe { ffi::ibv_alloc_pd(ctx.ctx) }, "ibv_alloc_pd")?;
        Ok(Arc::new(Pd {
            ctx: ctx.clone(),
            pd,
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: memory regions and queue pairs hold an Arc to this domain, so none is left.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A registered memory region.
pub struct Mr {
    _pd: Arc<Pd>,
    mr: *mut ffi::ibv_mr,
    /// Owned backing memory, when the region was allocated here (staging buffers).
    owned: Option<Vec<u8>>,
}

// SAFETY: the MR handle is immutable after registration; access to the bytes is the owner's.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr` for local and remote writes.
    ///
    /// # Safety
    /// `addr..addr + len` must stay allocated, unmoved and not freed while the region lives,
    /// and nothing may rely on its contents while a peer may be writing into it.
    pub unsafe fn register(pd: &Arc<Pd>, addr: *mut u8, len: usize) -> io::Result<Mr> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        // SAFETY: the caller keeps the memory valid; the domain is live.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr.cast(), len, access.0 as i32) };
        Ok(Mr {
            _pd: pd.clone(),
            mr: null(mr, "ibv_reg_mr")?,
            owned: None,
        })
    }

    /// Allocates and registers a zeroed buffer of `len` bytes (for staging).
    pub fn alloc(pd: &Arc<Pd>, len: usize) -> io::Result<Mr> {
        let mut buf = vec![0u8; len.max(1)];
        // SAFETY: the buffer is owned by the region and dropped after it is deregistered.
        let mut mr = unsafe { Mr::register(pd, buf.as_mut_ptr(), buf.len())? };
        mr.owned = Some(buf);
        Ok(mr)
    }

    /// The registered bytes of an allocated region.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.owned.as_deref_mut().unwrap_or_default()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        // SAFETY: the handle is valid while `self` lives.
        unsafe { (*self.mr).addr as u64 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.mr).length }
    }

    /// The key for local scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).lkey }
    }

    /// The key a peer writes with.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; `owned` drops after this.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// A completion queue.
pub struct Cq {
    _ctx: Arc<Context>,
    cq: *mut ffi::ibv_cq,
}

// SAFETY: polling a CQ is thread-safe in libibverbs.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// A queue of at least `depth` entries.
    pub fn new(ctx: &Arc<Context>, depth: i32) -> io::Result<Arc<Cq>> {
        // SAFETY: the context is open; no channel, vector 0.
        let cq = unsafe {
            ffi::ibv_create_cq(
                ctx.ctx,
                depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        Ok(Arc::new(Cq {
            _ctx: ctx.clone(),
            cq: null(cq, "ibv_create_cq")?,
        }))
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut [ffi::ibv_wc]) -> io::Result<usize> {
        // SAFETY: the CQ is live; its context's ops table is filled by the driver.
        let n = unsafe {
            let ops = &(*(*self.cq).context).ops;
            ops.poll_cq.expect("driver has poll_cq")(self.cq, out.len() as i32, out.as_mut_ptr())
        };
        if n < 0 {
            return Err(io::Error::other("ibv_poll_cq failed"));
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: queue pairs using this CQ hold an Arc to it, so none is left.
        unsafe { ffi::ibv_destroy_cq(self.cq) };
    }
}

/// How to reach a queue pair: exchanged over the side channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Port LID (InfiniBand).
    pub lid: u16,
    /// GID (RoCE), if the port has one.
    pub gid: Option<[u8; 16]>,
}

/// A reliable-connected queue pair, created but not yet connected.
pub struct PreparedQp {
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    qp: *mut ffi::ibv_qp,
}

// SAFETY: a QP may be used from any thread (not concurrently; `&mut` guards posting).
unsafe impl Send for PreparedQp {}

impl PreparedQp {
    /// An RC queue pair on `pd` whose send and receive completions go to `cq`.
    pub fn new(pd: &Arc<Pd>, cq: &Arc<Cq>, max_send: u32, max_recv: u32) -> io::Result<PreparedQp> {
        let mut attr = ffi::ibv_qp_init_attr {
            send_cq: cq.cq,
            recv_cq: cq.cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: max_send,
                max_recv_wr: max_recv,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: the domain and CQ are live and outlive the QP (held by Arc).
        let qp = null(
            unsafe { ffi::ibv_create_qp(pd.pd, &mut attr) },
            "ibv_create_qp",
        )?;
        Ok(PreparedQp {
            pd: pd.clone(),
            cq: cq.clone(),
            qp,
        })
    }

    /// This end's address, to send to the peer.
    pub fn endpoint(&self) -> Endpoint {
        let ctx = &self.pd.ctx;
        Endpoint {
            // SAFETY: the QP is live.
            qpn: unsafe { (*self.qp).qp_num },
            lid: ctx.lid,
            gid: ctx.gid,
        }
    }

    /// Moves the queue pair through INIT, RTR and RTS towards `remote`, allowing the peer to
    /// write into this side's regions.
    pub fn connect(self, remote: Endpoint) -> io::Result<Qp> {
        let ctx = &self.pd.ctx;
        let modify = |attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, what: &str| {
            // SAFETY: the QP is live; `attr` is initialised for the fields `mask` names.
            errno(
                unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) },
                what,
            )
        };
        use ffi::ibv_qp_attr_mask as M;
        let mut init = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0,
            ..Default::default()
        };
        modify(
            &mut init,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        let mut rtr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: ffi::IBV_MTU_1024,
            dest_qp_num: remote.qpn,
            rq_psn: 0,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr {
                dlid: remote.lid,
                port_num: PORT,
                ..Default::default()
            },
            ..Default::default()
        };
        if let Some(gid) = remote.gid {
            rtr.ah_attr.is_global = 1;
            rtr.ah_attr.grh.dgid = ffi::ibv_gid { raw: gid };
            rtr.ah_attr.grh.hop_limit = 0xff;
            rtr.ah_attr.grh.sgid_index = ctx.gid_index;
        }
        modify(
            &mut rtr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        let mut rts = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        modify(
            &mut rts,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )?;
        Ok(Qp { prepared: self })
    }
}

impl Drop for PreparedQp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once; the CQ and domain outlive it (Arc).
        unsafe { ffi::ibv_destroy_qp(self.qp) };
    }
}

/// One RDMA WRITE: `len` bytes from `local` (in region `lkey`) to `remote` (key `rkey`).
#[derive(Debug, Clone, Copy)]
pub struct Write {
    /// Local address.
    pub local: u64,
    /// Local key.
    pub lkey: u32,
    /// Bytes.
    pub len: u32,
    /// Remote address.
    pub remote: u64,
    /// Remote key.
    pub rkey: u32,
}

/// A connected queue pair.
pub struct Qp {
    prepared: PreparedQp,
}

impl Qp {
    /// The completion queue of this queue pair.
    pub fn cq(&self) -> &Arc<Cq> {
        &self.prepared.cq
    }

    /// Posts `writes` as one linked list; the last one carries `imm` (delivered to the peer's
    /// receive queue) and is signaled with `wr_id`, the others are unsignaled.
    ///
    /// # Safety
    /// The local and remote ranges must lie in live registered regions, and the local bytes
    /// must stay valid and unchanged until the completion of `wr_id` has been polled.
    pub unsafe fn post_writes(&mut self, writes: &[Write], imm: u32, wr_id: u64) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.post(writes, Some(imm), wr_id) }
    }

    /// [`Qp::post_writes`] without an immediate: the peer sees nothing of these writes.
    ///
    /// # Safety
    /// As for [`Qp::post_writes`].
    pub unsafe fn post_writes_plain(&mut self, writes: &[Write], wr_id: u64) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.post(writes, None, wr_id) }
    }

    /// # Safety
    /// As for [`Qp::post_writes`].
    unsafe fn post(&mut self, writes: &[Write], imm: Option<u32>, wr_id: u64) -> io::Result<()> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ffi::ibv_sge> = writes
            .iter()
            .map(|w| ffi::ibv_sge {
                addr: w.local,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut wrs: Vec<ffi::ibv_send_wr> = Vec::with_capacity(writes.len());
        for (i, w) in writes.iter().enumerate() {
            let last = i + 1 == writes.len();
            let mut wr = ffi::ibv_send_wr {
                wr_id,
                num_sge: 1,
                opcode: if last && imm.is_some() {
                    ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                } else {
                    ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                },
                send_flags: if last {
                    ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
                } else {
                    0
                },
                ..Default::default()
            };
            wr.wr.rdma.remote_addr = w.remote;
            wr.wr.rdma.rkey = w.rkey;
            if let (true, Some(imm)) = (last, imm) {
                wr.__bindgen_anon_1.imm_data = imm.to_be();
            }
            wrs.push(wr);
        }
        let base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate() {
            wr.sg_list = &mut sges[i];
            wr.next = if i + 1 < writes.len() {
                // SAFETY: in bounds of `wrs`, which does not move while posting.
                unsafe { base.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
        }
        let mut bad = std::ptr::null_mut();
        let qp = self.prepared.qp;
        // SAFETY: the list is well formed and lives across the call; the caller keeps the
        // memory valid until completion.
        let rc = unsafe {
            let ops = &(*(*qp).context).ops;
            ops.post_send.expect("driver has post_send")(qp, base, &mut bad)
        };
        errno(rc, "ibv_post_send")
    }

    /// Posts a receive with no buffer: it only takes the immediate of a peer's WRITE.
    ///
    /// # Safety
    /// None beyond a live queue pair; `unsafe` because it posts work to the device.
    pub unsafe fn post_empty_recv(&mut self, wr_id: u64) -> io::Result<()> {
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = std::ptr::null_mut();
        let qp = self.prepared.qp;
        // SAFETY: a zero-length receive references no memory.
        let rc = unsafe {
            let ops = &(*(*qp).context).ops;
            ops.post_recv.expect("driver has post_recv")(qp, &mut wr, &mut bad)
        };
        errno(rc, "ibv_post_recv")
    }
}
