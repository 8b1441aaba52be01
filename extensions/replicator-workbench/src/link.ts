/**
 * One kernel's connection to the workbench helper: a comm of target COMM_TARGET.
 *
 * When made, the link asks the kernel for comms of the target (comm_info): where the helper is
 * loaded there is at least the one it opened, and the link opens its own ("hello", answered
 * with a snapshot); elsewhere the state is 'absent' until `%load_ext workbench` opens a comm
 * from the kernel, which the link adopts.
 * It never polls: the kernel pushes a snapshot whenever something changes.
 */

import { Kernel, KernelMessage } from '@jupyterlab/services';
import { JSONObject } from '@lumino/coreutils';
import { ISignal, Signal } from '@lumino/signaling';

import { COMM_TARGET, ISnapshot, LinkState, parseSnapshot } from './model';

export class KernelLink {
  constructor(readonly kernel: Kernel.IKernelConnection) {
    kernel.registerCommTarget(COMM_TARGET, (comm, msg) => this._adopt(comm, msg.content.data));
    kernel.statusChanged.connect(this._onStatus, this);
    void this._open();
  }

  get state(): LinkState {
    return this._state;
  }

  get snapshot(): ISnapshot | null {
    return this._snapshot;
  }

  /** A new snapshot or state. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Replies other than snapshots ("figure", "error"). */
  get replies(): ISignal<this, JSONObject> {
    return this._replies;
  }

  /** Sends a request to the kernel helper; false when there is no live comm. */
  send(data: JSONObject): boolean {
    if (!this._comm || this._comm.isDisposed) {
      return false;
    }
    this._comm.send(data);
    return true;
  }

  dispose(): void {
    this.kernel.statusChanged.disconnect(this._onStatus, this);
    Signal.clearData(this);
  }

  private async _open(): Promise<void> {
    if (this.kernel.isDisposed || !this.kernel.handleComms) {
      this._set('absent');
      return;
    }
    this._set('connecting');
    // Ask which comms of our target exist before opening one: opening a comm to a kernel
    // without the target would log an error there for every notebook opened.
    let loaded = false;
    try {
      const reply = await this.kernel.requestCommInfo({ target_name: COMM_TARGET });
      loaded = reply.content.status === 'ok' && Object.keys(reply.content.comms).length > 0;
    } catch {
      loaded = false; // the kernel went away meanwhile
    }
    if (this._state === 'ready' || this.kernel.isDisposed) {
      return; // the kernel's own comm arrived meanwhile (%load_ext ran)
    }
    if (!loaded) {
      this._set('absent'); // until %load_ext workbench opens a comm from the kernel
      return;
    }
    const comm = this.kernel.createComm(COMM_TARGET);
    this._adopt(comm, null);
    comm.open({ type: 'hello' });
  }

  private _adopt(comm: Kernel.IComm, data: unknown): void {
    this._comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this._onData(comm, msg.content.data);
    comm.onClose = () => {
      if (this._comm === comm) {
        // The kernel closed it: no helper there (or the helper went away).
        this._comm = null;
        this._set('absent');
      }
    };
    if (data) {
      this._onData(comm, data);
    }
  }

  private _onData(comm: Kernel.IComm, data: unknown): void {
    const snapshot = parseSnapshot(data);
    if (snapshot) {
      this._comm = comm; // the comm that last spoke is live
      this._snapshot = snapshot;
      this._set('ready', true);
    } else if (typeof data === 'object' && data !== null) {
      this._replies.emit(data as JSONObject);
    }
  }

  private _onStatus(_: Kernel.IKernelConnection, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      // A new kernel process: nothing is loaded there until %load_ext runs again.
      this._comm = null;
      this._snapshot = null;
      this._set('absent', true);
    }
  }

  private _set(state: LinkState, force = false): void {
    if (state !== this._state || force) {
      this._state = state;
      this._changed.emit();
    }
  }

  private _state: LinkState = 'connecting';
  private _snapshot: ISnapshot | null = null;
  private _comm: Kernel.IComm | null = null;
  private _changed = new Signal<this, void>(this);
  private _replies = new Signal<this, JSONObject>(this);
}
