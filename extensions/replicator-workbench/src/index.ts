/**
 * Replicator Workbench for JupyterLab: wiring only. The sidebar (sidebar.ts), the status bar
 * item (statusbar.ts) and the four commands follow the active notebook's kernel through its
 * KernelLink (link.ts); what to show and what Stop does are pure functions in model.ts.
 */

import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import {
  Dialog,
  ICommandPalette,
  InputDialog,
  MainAreaWidget,
  Notification,
  showDialog
} from '@jupyterlab/apputils';
import { DocumentRegistry } from '@jupyterlab/docregistry';
import { INotebookModel, INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { addIcon, CommandToolbarButton, imageIcon, LabIcon, stopIcon } from '@jupyterlab/ui-components';
import { JSONObject } from '@lumino/coreutils';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';
import { Widget } from '@lumino/widgets';

import { KernelLink } from './link';
import {
  deleteRunsText,
  formatNumber,
  ISnapshot,
  IStoredRun,
  lastEndedRun,
  newlyEndedLongRuns,
  runningRun,
  statusBarText,
  stopAction
} from './model';
import { CompareView } from './compare';
import { ReplicatorSidebar } from './sidebar';
import { ReplicatorStatus } from './statusbar';
import { templateCell } from './templates';

/** Command ids, in the 'workbench:verb-noun' namespace. */
export const CommandIds = {
  insertTemplate: 'workbench:insert-template',
  openSidebar: 'workbench:open-sidebar',
  stopRun: 'workbench:stop-run',
  openFigure: 'workbench:open-figure'
} as const;

const SIDEBAR_ID = 'replicator-workbench-sidebar';
const CATEGORY = 'Replicator Workbench';

/** Four devices side by side: the replicas. */
const replicasIcon = new LabIcon({
  name: 'replicator-workbench:replicas',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<rect x="2" y="4" width="9" height="7" rx="1"/><rect x="13" y="4" width="9" height="7" rx="1"/>' +
    '<rect x="2" y="13" width="9" height="7" rx="1"/><rect x="13" y="13" width="9" height="7" rx="1"/>' +
    '</g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'replicator-workbench:plugin',
  description: 'Replicator sidebar, status bar item and commands for the Replicator Workbench.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette, IStatusBar],
  activate
};

function activate(
  app: JupyterFrontEnd,
  tracker: INotebookTracker,
  palette: ICommandPalette | null,
  statusBar: IStatusBar | null
): void {
  const links = new Map<Kernel.IKernelConnection, KernelLink>();
  let current: KernelLink | null = null;
  let enabledKey = '';

  const sidebar = new ReplicatorSidebar({
    stop: runId => void stopRun(runId),
    openFigure: runId => requestFigure(runId),
    insertTemplate: () => void app.commands.execute(CommandIds.insertTemplate),
    exportRun: (runId, what) => sendOrWarn({ type: 'export', run_id: runId, what }),
    tensorboard: runId => void openTensorBoard(runId),
    requestRuns: () => sendOrWarn({ type: 'runs' }),
    compare: runIds => sendOrWarn({ type: 'compare', run_ids: runIds }),
    deleteRuns: (runIds, names) => void deleteRuns(runIds, names),
    renameRun: row => void renameRun(row),
    tagRun: row => void tagRun(row),
    shutdownPools: () => sendOrWarn({ type: 'shutdown_pools' })
  });
  sidebar.id = SIDEBAR_ID;
  sidebar.title.icon = replicasIcon;
  sidebar.title.caption = 'Replicator: devices, replicator, worker pools, runs';
  app.shell.add(sidebar, 'right', { rank: 700 });

  const status = new ReplicatorStatus(() => void app.commands.execute(CommandIds.openSidebar));
  statusBar?.registerStatusItem('replicator-workbench:status', {
    item: status,
    align: 'left',
    rank: 5,
    isActive: () => true
  });

  function linkFor(kernel: Kernel.IKernelConnection): KernelLink {
    let link = links.get(kernel);
    if (!link) {
      const made = new KernelLink(kernel);
      made.changed.connect(() => {
        tellTheme(made);
        notifyFor(made); // every kernel's runs, not only the active notebook's
        if (made === current) {
          refresh();
        }
      });
      made.replies.connect((_, reply) => onReply(reply));
      kernel.disposed.connect(() => {
        links.delete(kernel);
        made.dispose();
      });
      links.set(kernel, made);
      link = made;
    }
    return link;
  }

  /** Follows the active notebook's kernel. */
  function follow(): void {
    const kernel = tracker.currentWidget?.sessionContext.session?.kernel ?? null;
    current = kernel && !kernel.isDisposed ? linkFor(kernel) : null;
    refresh();
  }

  let previous: ISnapshot | null = null;
  let asked: KernelLink | null = null;
  function refresh(): void {
    const state = current?.state ?? 'no-kernel';
    const snapshot = current?.snapshot ?? null;
    if (current && state === 'ready' && (asked !== current || newlyEnded(previous, snapshot))) {
      asked = current; // the run store changed (a run ended) or a new kernel: ask for its table
      current.send({ type: 'runs' });
    }
    previous = snapshot;
    sidebar.render(state, snapshot, tracker.currentWidget?.title.label ?? '');
    status.setText(statusBarText(state, snapshot), runningRun(snapshot) !== null);
    status.node.dataset.snapshot = String(runningRun(snapshot)?.snapshot_seq ?? 0); // (as the cards)
    // Toolbar buttons and the palette grey out Stop / Figure; tell them only when that changes.
    const key = `${stopAction(snapshot).kind}|${lastEndedRun(snapshot)?.id ?? ''}|${tracker.currentWidget?.id}`;
    if (key !== enabledKey) {
      enabledKey = key;
      app.commands.notifyCommandChanged();
    }
  }

  // Every notebook's kernel gets its link (and so our comm target) as soon as its connection
  // exists, whichever notebook is current: a kernel connection without the target closes the
  // comm that `%load_ext workbench` opens, and that notebook's sidebar would stay 'absent'.
  function linkKernelOf(panel: NotebookPanel): void {
    const kernel = panel.sessionContext.session?.kernel ?? null;
    if (kernel && !kernel.isDisposed) {
      linkFor(kernel);
    }
  }
  tracker.widgetAdded.connect((_, panel) => {
    linkKernelOf(panel);
    panel.sessionContext.kernelChanged.connect(() => {
      linkKernelOf(panel);
      if (panel === tracker.currentWidget) {
        follow();
      }
    });
  });
  tracker.currentChanged.connect(follow);

  async function stopRun(runId?: string): Promise<void> {
    const link = current;
    const action = stopAction(link?.snapshot ?? null, runId);
    if (!link || action.kind === 'none') {
      Notification.info('No run is training in this notebook\u2019s kernel.', { autoClose: 4000 });
    } else if (action.kind === 'interrupt') {
      // A foreground run holds the kernel's shell, so a comm message would wait for its end;
      // the run loop turns the interrupt into a clean stop at the next step boundary.
      await link.kernel.interrupt();
    } else {
      link.send({ type: 'stop', run_id: action.run?.id ?? null });
    }
  }

  function requestFigure(runId?: string): void {
    const target = runId ?? lastEndedRun(current?.snapshot ?? null)?.id ?? null;
    if (!current || !current.send({ type: 'figure', run_id: target })) {
      Notification.warning('The workbench is not loaded in this notebook\u2019s kernel: run %load_ext workbench.', {
        autoClose: 5000
      });
    }
  }

  /** A run started or ended since the last snapshot: the run store's table changed. */
  function newlyEnded(before: ISnapshot | null, after: ISnapshot | null): boolean {
    const key = (s: ISnapshot | null) =>
      (s?.runs ?? []).map(r => `${r.id}:${r.ended === null ? 'open' : 'ended'}`).join(',');
    return key(after) !== key(before);
  }

  /**
   * The page's theme, told to every kernel: figures drawn there follow it (dark figures on a dark
   * theme). JupyterLab marks the body with data-jp-theme-light; watching that attribute catches
   * every switch without depending on the theme manager.
   */
  const toldDark = new Map<KernelLink, boolean>();
  const isDark = () => document.body.dataset.jpThemeLight === 'false';
  function tellTheme(link: KernelLink): void {
    const dark = isDark();
    if (link.state === 'ready' && toldDark.get(link) !== dark && link.send({ type: 'theme', dark })) {
      toldDark.set(link, dark);
    }
  }
  new MutationObserver(() => links.forEach(link => tellTheme(link))).observe(document.body, {
    attributes: true,
    attributeFilter: ['data-jp-theme-light']
  });

  /**
   * Long runs of `link`'s kernel that ended since its last snapshot, told when their notebook is
   * not what the user looks at. Every link is watched, not only the active notebook's: the
   * commonest case is a run ending while another notebook is the active tab.
   */
  const seen = new Map<KernelLink, ISnapshot | null>();
  function notifyFor(link: KernelLink): void {
    const before = seen.get(link) ?? null;
    seen.set(link, link.snapshot);
    for (const run of newlyEndedLongRuns(before, link.snapshot)) {
      notifyEnded(link, run.name, run.status, run.steps_per_sec);
    }
  }

  /** A long run ended: tell the user unless its notebook is the active, visible tab. */
  function notifyEnded(link: KernelLink, name: string, status: string, stepsPerSec: number | null): void {
    const panel = tracker.currentWidget;
    const looking =
      !document.hidden && !!panel && panel.isVisible && panel.sessionContext.session?.kernel === link.kernel;
    if (looking) {
      return;
    }
    const text = `${name} ${status} (${formatNumber(stepsPerSec)} steps/s)`;
    Notification.info(`Replicator Workbench: ${text}`, { autoClose: 10000 });
    if (document.hidden && 'Notification' in window && window.Notification.permission === 'granted') {
      new window.Notification('Replicator Workbench', { body: text });
    }
  }

  function sendOrWarn(data: JSONObject): boolean {
    if (!current || !current.send(data)) {
      Notification.warning('The workbench is not loaded in this notebook\u2019s kernel: run %load_ext workbench.', {
        autoClose: 5000
      });
      return false;
    }
    return true;
  }

  async function renameRun(row: IStoredRun): Promise<void> {
    const answer = await InputDialog.getText({
      title: 'Rename run',
      label: `A name unique in the run store (now: ${row.name ?? row.id})`,
      text: row.name ?? ''
    });
    if (answer.button.accept && answer.value && answer.value.trim() && answer.value !== row.name) {
      sendOrWarn({ type: 'rename', run_id: row.id, name: answer.value.trim() });
    }
  }

  async function tagRun(row: IStoredRun): Promise<void> {
    const answer = await InputDialog.getText({
      title: 'Tag run',
      label: `Tags of ${row.name ?? row.id}, separated by commas`,
      text: row.tags ?? ''
    });
    if (answer.button.accept && answer.value !== null) {
      const tags = answer.value
        .split(',')
        .map(t => t.trim())
        .filter(Boolean);
      sendOrWarn({ type: 'tag', run_id: row.id, tags });
    }
  }

  async function deleteRuns(runIds: string[], names: string[]): Promise<void> {
    const body = document.createElement('pre'); // (one run a line, names as written)
    body.className = 'wb-delete-list';
    body.textContent = deleteRunsText(names);
    const answer = await showDialog({
      title: `Delete ${runIds.length} recorded run${runIds.length === 1 ? '' : 's'}?`,
      body: new Widget({ node: body }),
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Delete' })]
    });
    if (answer.button.accept) {
      sendOrWarn({ type: 'delete', run_ids: runIds });
    }
  }

  /** A cell below the active one runs `%replicate --tensorboard <run id>` (IPython's %tensorboard). */
  async function openTensorBoard(runId: string): Promise<void> {
    const panel = tracker.currentWidget;
    if (!panel) {
      return;
    }
    // One cell made with its source (insertBelow, then setSource on the active cell, left an
    // empty cell above the one that ran: the active cell had not moved to the new one yet).
    const notebook = panel.content;
    const index = Math.max(0, notebook.activeCellIndex) + 1;
    notebook.model?.sharedModel.insertCell(index, {
      cell_type: 'code',
      source: `%replicate --tensorboard ${runId}`
    });
    notebook.activeCellIndex = index;
    notebook.deselectAll();
    await NotebookActions.run(notebook, panel.sessionContext);
  }

  function download(filename: string, mime: string, base64: string): void {
    const bytes = Uint8Array.from(atob(base64), c => c.charCodeAt(0));
    const url = URL.createObjectURL(new Blob([bytes], { type: mime }));
    const link = document.createElement('a');
    link.href = url;
    link.download = filename;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  let comparisons = 0;
  function showComparison(reply: JSONObject): void {
    const content = new CompareView(reply);
    const widget = new MainAreaWidget({ content });
    comparisons += 1;
    widget.id = `wb-compare-${comparisons}`;
    widget.title.label = `Compare ${(reply.run_ids as string[]).length} runs`;
    widget.title.icon = imageIcon;
    widget.title.closable = true;
    app.shell.add(widget, 'main');
    app.shell.activateById(widget.id);
  }

  const figures = new Map<string, MainAreaWidget>();
  function onReply(reply: JSONObject): void {
    if (reply.type === 'runs') {
      sidebar.setStoredRuns((reply.rows as unknown as IStoredRun[]) ?? []);
    } else if (reply.type === 'compare') {
      showComparison(reply);
    } else if (reply.type === 'export') {
      download(String(reply.filename), String(reply.mime), String(reply.data));
    } else if (reply.type === 'error') {
      Notification.warning(String(reply.text), { autoClose: 6000 });
    } else if (reply.type === 'figure') {
      const runId = String(reply.run_id);
      let widget = figures.get(runId);
      if (!widget || widget.isDisposed) {
        const content = new Widget();
        content.addClass('wb-figure-view');
        const img = document.createElement('img');
        img.src = `data:image/png;base64,${String(reply.png)}`;
        img.alt = `${String(reply.name)}: dashboard figure`;
        content.node.append(img);
        widget = new MainAreaWidget({ content });
        widget.id = `wb-figure-${runId}`;
        widget.title.label = `${String(reply.name)} dashboard`;
        widget.title.icon = imageIcon;
        widget.title.closable = true;
        figures.set(runId, widget);
        app.shell.add(widget, 'main'); // a tab beside the notebook
      }
      app.shell.activateById(widget.id);
    }
  }

  app.commands.addCommand(CommandIds.insertTemplate, {
    label: 'Insert input_fn/step_fn Template Cell',
    caption: 'Insert a %%replicate cell defining input_fn and step_fn below the active cell',
    icon: addIcon,
    isEnabled: () => tracker.currentWidget !== null,
    execute: () => {
      const panel = tracker.currentWidget;
      if (!panel) {
        return;
      }
      NotebookActions.insertBelow(panel.content);
      panel.content.activeCell?.model.sharedModel.setSource(templateCell(current?.snapshot ?? null));
    }
  });
  app.commands.addCommand(CommandIds.openSidebar, {
    label: 'Open the Replicator Sidebar',
    caption: 'Devices, the session replicator and the runs of this notebook\u2019s kernel',
    icon: replicasIcon,
    execute: () => app.shell.activateById(SIDEBAR_ID)
  });
  app.commands.addCommand(CommandIds.stopRun, {
    label: 'Stop the Running Run',
    caption: 'Stop the training run at the next step boundary',
    icon: stopIcon,
    isEnabled: () => stopAction(current?.snapshot ?? null).kind !== 'none',
    execute: () => stopRun()
  });
  app.commands.addCommand(CommandIds.openFigure, {
    label: 'Open the Last Run\u2019s Dashboard Figure',
    caption: 'Show the dashboard figure of the last run that ended',
    icon: imageIcon,
    isEnabled: () => lastEndedRun(current?.snapshot ?? null) !== null,
    execute: () => requestFigure()
  });
  for (const command of Object.values(CommandIds)) {
    palette?.addItem({ command, category: CATEGORY });
  }
  app.docRegistry.addWidgetExtension('Notebook', new ToolbarButtons(app));
  follow();
}

/** The notebook toolbar's buttons (command, class name for styling and tests). */
const TOOLBAR: [string, string][] = [
  [CommandIds.insertTemplate, 'wb-toolbar-insert'],
  [CommandIds.stopRun, 'wb-toolbar-stop'],
  [CommandIds.openSidebar, 'wb-toolbar-sidebar']
];

class ToolbarButtons implements DocumentRegistry.IWidgetExtension<NotebookPanel, INotebookModel> {
  constructor(private readonly app: JupyterFrontEnd) {}

  createNew(panel: NotebookPanel): IDisposable {
    const buttons = TOOLBAR.map(([id, className], i) => {
      const button = new CommandToolbarButton({ commands: this.app.commands, id, label: '' });
      button.addClass(className);
      panel.toolbar.insertItem(10 + i, className, button);
      return button;
    });
    return new DisposableDelegate(() => buttons.forEach(b => b.dispose()));
  }
}

export default plugin;
